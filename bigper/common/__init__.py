"""What every layer of bigper shares, below them all: the compiled kernels' one
decorator (``kernels``), the slot status codes (``status``), the thread pool
of bulk jobs (``pool``), reused output arrays (``reuse``), the undo journal
of a write (``undo``) and the file helpers (``files``: locks, fsync, real names)."""
