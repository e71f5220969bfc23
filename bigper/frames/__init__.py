"""Frames stored once: the frame ring and each row's references (``store``),
the compressed log that grows as its frames need (``segments``), its zstd
dictionaries (``dictionaries``) and libzstd called from numba (``zstd``),
the log's geometry (``budget``), and each row's distinct frames of a
sequence batch (``distinct``)."""
