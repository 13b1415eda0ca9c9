"""Moving samples and batches between processes through POSIX shared memory.

Used by the Loader (batch segments from its workers) and by the global loader service (the
server's arena, read in place by its clients); neither of those imports the other for it.
"""
