"""Engine core: scheduler, KV-cache manager, model runner and the busy loop that owns the device."""
