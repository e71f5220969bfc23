"""The core of a buffer: the ring's bookkeeping (``ring``), what a leaf
stands for (``units``: transitions or sequence items), the write and read
paths (``writer``, ``reader``, ``ingest``), and what opening, checking and
living in a process take (``opening``, ``statecheck``, ``lifecycle``).
``bigper.buffer`` composes them; nothing here imports the buffer."""
