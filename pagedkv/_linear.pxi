# The row-batch linear kernel (include/pagedkv/linear.h): y = x W^T + bias for
# the few rows of a decode step.  Included by _core.pyx.


cdef cnp.ndarray _linear_operand(object a, str name, int ndim, int typenum):
    """`a` as an aligned C-contiguous array of ndim dimensions and the dtype of
    typenum (float32 or float64); no copy when it already is one."""
    cdef cnp.ndarray arr = _as_array(a, name)
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-d, got shape {np.shape(arr)}")
    if arr.dtype.kind != "f":
        raise TypeError(f"{name} must be a float array, got dtype {arr.dtype}")
    if cnp.PyArray_TYPE(arr) == typenum and cnp.PyArray_ISCARRAY_RO(arr):
        return arr
    return np.require(arr, np.float64 if typenum == cnp.NPY_FLOAT64 else np.float32,
                      ("C_CONTIGUOUS", "ALIGNED"))


def linear(x, weight, bias=None, out=None):
    """y = x @ weight.T + bias, for a few rows of x (a decode step's batch).

    x [M, K] and weight [N, K] (the layout of torch's ``nn.Linear.weight``),
    float32 or float64: the weight's dtype is the compute dtype, x and bias
    are converted to it.  bias [N] or None.  out, when given, is an aligned
    C-contiguous writable [M, N] array of that dtype not overlapping the
    inputs; returns the [M, N] result.

    The weight is read once, in tiles of 4 rows each folded into 3 rows of x
    at a time (include/pagedkv/linear_impl.h), its rows split over
    ``get_num_threads()`` threads; the GIL is released.  Sums run in the
    compute dtype in another order than a BLAS, so results agree with
    ``x @ weight.T`` to the dtype's rounding, not bit for bit.
    """
    cdef cnp.ndarray w = _as_array(weight, "weight")
    if w.dtype != np.float32 and w.dtype != np.float64:
        raise TypeError(f"weight must be float32 or float64, got dtype {w.dtype}")
    cdef int typenum = cnp.PyArray_TYPE(w)
    w = _linear_operand(w, "weight", 2, typenum)
    cdef cnp.ndarray xa = _linear_operand(x, "x", 2, typenum)
    cdef int64_t M = xa.shape[0], K = xa.shape[1], N = w.shape[0]
    if w.shape[1] != K:
        raise ValueError(f"x has {K} columns but weight has {w.shape[1]} "
                         f"(x [M, K], weight [N, K])")
    cdef cnp.ndarray b = None
    if bias is not None:
        b = _linear_operand(bias, "bias", 1, typenum)
        if b.shape[0] != N:
            raise ValueError(f"bias must have {N} values (one per row of weight), "
                             f"got shape {np.shape(b)}")
    cdef cnp.ndarray y
    if out is None:
        y = cnp.PyArray_EMPTY(2, [M, N], typenum, 0)
    else:
        if not cnp.PyArray_Check(out):
            raise TypeError(f"out must be a numpy array, got {type(out).__name__}")
        y = <cnp.ndarray>out
        if cnp.PyArray_TYPE(y) != typenum:
            raise TypeError(f"out must have dtype {w.dtype}, got {y.dtype}")
        if y.ndim != 2 or y.shape[0] != M or y.shape[1] != N:
            raise ValueError(f"out must have shape [{M}, {N}], got {np.shape(y)}")
        if not cnp.PyArray_ISCARRAY(y):
            raise ValueError("out must be C-contiguous, aligned and writable")
        for a, name in ((xa, "x"), (w, "weight"), (b, "bias")):
            if a is not None and np.may_share_memory(y, a):
                raise ValueError(f"out must not overlap {name}")
    if M == 0 or N == 0:
        return y
    cdef const void *xp = cnp.PyArray_DATA(xa)
    cdef const void *wp = cnp.PyArray_DATA(w)
    cdef const void *bp = cnp.PyArray_DATA(b) if b is not None else NULL
    cdef void *yp = cnp.PyArray_DATA(y)
    cdef int f64 = typenum == cnp.NPY_FLOAT64
    cdef int nt = get_num_threads()
    with nogil:
        pkv_linear(f64, _simd, nt, xp, M, wp, bp, K, N, yp, N)
    return y
