"""The device tier: the stored data mirrored in a torch device's memory
(``mirror``), and priority updates from device tensors applied without a
stall (``deferred``). Torch is imported only when a buffer asks for a device."""
