"""The life of worker processes, once for every pool: start, death, timeout, stop, parent death."""
