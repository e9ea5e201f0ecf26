# The cache's lock and hold().  Included by _core.pyx (one extension module).
#
# Thread model.  One lock per cache serializes every call that reads or
# changes sequences or blocks: a second thread waits for it with the GIL
# released, so the first one's kernels (which run without the GIL) finish.
# Separate caches share nothing and run in parallel.  The lock is
# reentrant for the thread holding it, so the facade can hold it across
# several calls (hold()); a public call started from inside another on the
# same thread (an array's __array__ running during input conversion) raises
# RuntimeError instead of seeing a half-done call.
#
# The lock's state (owner, depth, waiters) is guarded by the GIL: testing
# and taking a free cache is two plain loads and stores, with no Python code
# in between, so the uncontended cost is a few nanoseconds (a pthread-backed
# try-acquire + release measured ~+40-100 ns per append).  Only a thread
# that finds the cache taken blocks, on the `wake` semaphore, without the
# GIL; every release with waiters posts it once, and a woken thread checks
# again (a post can be spurious: another thread may have taken the cache
# first).  This relies on the GIL: a free-threaded build would need an
# atomic compare-and-swap here.
#
# Every public CacheCore method is `_call_enter(&self.lock)`, the work, then
# `_call_exit(&self.lock)` in a `finally:`; the functions here are inline C.


ctypedef struct _Lock:
    # every field but the semaphore is read and written with the GIL held
    unsigned long owner       # thread holding the cache, 0 when none
    int depth                 # holds by the owner (hold() nests, calls nest in hold())
    int waiters               # threads waiting for the cache
    PyThread_type_lock wake   # posted when the owner lets go and someone waits
    bint in_call              # a public call is under way on the owner thread


cdef int _lock_init(_Lock *lk) except -1:
    """Allocate the semaphore, taken: waiters block on it."""
    lk.wake = PyThread_allocate_lock()
    if lk.wake == NULL:
        raise MemoryError("cannot allocate the cache's lock")
    PyThread_acquire_lock(lk.wake, WAIT_LOCK)
    return 0


cdef void _lock_free(_Lock *lk) noexcept:
    if lk.wake != NULL:
        PyThread_release_lock(lk.wake)
        PyThread_free_lock(lk.wake)
        lk.wake = NULL


cdef inline int _acquire(_Lock *lk) except -1:
    cdef unsigned long me = PyThread_get_thread_ident()
    if lk.owner == 0:
        lk.owner = me
        lk.depth = 1
        return 0
    if lk.owner == me:
        lk.depth += 1
        return 0
    lk.waiters += 1
    while lk.owner != 0:
        with nogil:
            PyThread_acquire_lock(lk.wake, WAIT_LOCK)
    lk.waiters -= 1
    lk.owner = me
    lk.depth = 1
    return 0


cdef inline void _release(_Lock *lk) noexcept:
    lk.depth -= 1
    if lk.depth == 0:
        lk.owner = 0
        if lk.waiters:
            PyThread_release_lock(lk.wake)


cdef inline int _call_enter(_Lock *lk) except -1:
    """Begin a public call: take the lock (waiting for another thread's call)."""
    _acquire(lk)
    if lk.in_call:
        _release(lk)
        raise RuntimeError(
            "a call on this cache was made from inside another call on it on the same "
            "thread (e.g. from an array's __array__ during input conversion)")
    lk.in_call = True
    return 0


cdef inline void _call_exit(_Lock *lk) noexcept:
    lk.in_call = False
    _release(lk)


cdef class _Hold:
    """`with core.hold():` -- see CacheCore.hold."""
    cdef object core          # keeps the cache (and so *lock) alive
    cdef _Lock *lock

    def __enter__(self):
        if self.lock == NULL:
            raise TypeError("_Hold objects are made by CacheCore.hold()")
        _acquire(self.lock)
        return self.core

    def __exit__(self, *exc):
        if self.lock != NULL:
            _release(self.lock)
        return False


cdef _Hold _hold(object core, _Lock *lock):
    cdef _Hold h = _Hold.__new__(_Hold)
    h.core = core
    h.lock = lock
    return h
