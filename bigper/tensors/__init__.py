"""The tensor path: torch imported only when asked for, and a ``Batch`` on its
way to a device.

- ``lazy``: ``load_torch``, and input in torch's terms (``as_device``,
  ``torch_dtype``, ``as_numpy``, ``as_array``, ``is_device_tensor``);
- ``transport``: what a batch carries for the trip (``Transport``) and what
  it gives back (``TensorBatch``);
- ``pinned``: the pinned blocks (``PinnedPool``) and a block laid out for one
  batch (``Staged``);
- ``transfer``: ``batch_to_torch``;
- ``streams``: a batch handed from a sampler's CUDA stream to the learner's.

It sits low in the layers (below the core and the device tier, which use it),
so that ``Batch.to_torch`` reaches it without an import upward.
"""
