"""What layers cache, and the pools that hold it: see :mod:`xinfer.cache.specs`."""
