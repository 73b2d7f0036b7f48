"""LoRA adapters served next to the base model (vLLM's ``--enable-lora``), many in one batch.

- ``peft``: read and check a PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``);
- ``manager``: the adapters of a rank: names and ids, the host-memory cache (loaded off the step loop, in a
  thread), the device slots (least recently used evicted among those no running request uses), telemetry;
- ``slot_book``: which adapter holds each device slot, LRU, running users (the sim rank's adapters too);
- ``slots``: the device buffers of every adapted projection and the per-step token -> slot map;
- ``compute``: y += (x @ A[slot]) @ B[slot] per slot group (CPU fast path, torch's gather path, Triton);
- ``triton_kernel``: the CUDA kernel.
"""
