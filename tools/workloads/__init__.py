"""The workloads of ``tools/bench.py``, one package each: ``workloads/<name>/main.py``
is what ``python tools/bench.py <name>`` runs (``add_arguments(parser)``, and
either ``func`` set on the parser's defaults or ``main(args) -> int``); the
package's other modules are its helpers and the scripts it starts in child
processes. tools/ is the import root (``import benchkit``,
``from workloads.atari.data import Stream``); a script started by path puts it
on sys.path itself."""
