"""Engine internals: scheduler, page pool, adapter manager, model runner, sampling."""
