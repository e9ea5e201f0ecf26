# Argument checks of CacheCore: dtypes, sizes, layers, arrays in and out,
# batches of ids, and the attention options.  Included by _core.pyx (one
# extension module).
#
# Every public call checks all of its arguments before it changes anything,
# so bad input raises a clear TypeError / ValueError and leaves the cache as
# it was.  The checks that append and attend run on every call are inline C
# with a fast path for the common case (an int layer, an array already of the
# cache's dtype, shape and layout); the messages are built only on failure.

# ----------------------------------------------------------------------------
# dtypes and sizes (the constructor)

cdef dict _KV_DTYPES = {"float32": PKV_F32, "float64": PKV_F64, "bfloat16": PKV_BF16,
                        "float16": PKV_F16, "int8": PKV_I8}
_KV_NAMES = {code: name for name, code in _KV_DTYPES.items()}
_KV_CHOICES = "None, 'float32', 'float64', 'bfloat16', 'float16' or 'int8'"
_DTYPE_CHOICES = "'float32', 'float64', 'bfloat16' or 'float16'"


def _code_of(value, str what, str choices, bint arrays):
    """The pkv_dtype code of a dtype given by name or NumPy dtype; arrays: not int8."""
    name = value if isinstance(value, str) else None
    if name is None:
        try:
            name = np.dtype(value).name
        except TypeError:
            raise TypeError(f"{what} must be {choices}, got {value!r}") from None
    if name not in _KV_DTYPES or (arrays and name == "int8"):
        raise TypeError(f"{what} must be {choices}, got {name!r}")
    return _KV_DTYPES[name]


def _dtype_code(dtype):
    """Code of the arrays' dtype (float32, float64, bfloat16, float16)."""
    return _code_of(dtype, "dtype", _DTYPE_CHOICES, True)


def _array_dtype(int code, bint raw16):
    """The NumPy dtype of the arrays a cache of dtype `code` takes and returns."""
    if code == PKV_F32:
        return np.dtype(np.float32)
    if code == PKV_F64:
        return np.dtype(np.float64)
    if raw16:
        return np.dtype(np.uint16)
    if code == PKV_F16:
        return np.dtype(np.float16)
    try:
        ml_dtypes = importlib.import_module("ml_dtypes")
    except ImportError:
        raise ImportError("dtype='bfloat16' takes ml_dtypes.bfloat16 arrays: install ml_dtypes "
                          "(pip install 'pagedkv[bf16]'), or pass raw16=True for uint16 arrays "
                          "holding bfloat16 bit patterns") from None
    return np.dtype(ml_dtypes.bfloat16)


def _kv_dtype_code(kv_dtype, int io):
    """Storage code for kv_dtype (None: the arrays' dtype `io`)."""
    if kv_dtype is None:
        return io
    code = _code_of(kv_dtype, "kv_dtype", _KV_CHOICES, False)
    if code == PKV_F64 and io != PKV_F64:
        raise ValueError("kv_dtype='float64' needs dtype='float64' (storage wider than the "
                         f"arrays in and out would only waste memory); got dtype="
                         f"{_KV_NAMES[io]!r}")
    return code


cdef inline bint _is_int(object value):
    """An int or NumPy integer, not a bool."""
    return (isinstance(value, (int, np.integer))
            and not isinstance(value, (bool, np.bool_)))


cdef double _number(object value, str name, str want) except? -1:
    """float(value) of an int or float that is not a bool (TypeError "name must be
    want" otherwise); an int beyond the float range gives inf."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(
            value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be {want}, got {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:
        return float("inf")


def _positive_int(name, value, minimum=1):
    if not _is_int(value):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _no_token_ids():
    raise TypeError("token_ids= is for caches made with prefix_caching=True")


# ----------------------------------------------------------------------------
# layers, ids and sequence states

cdef inline int _check_layer(CacheCore core, object layer) except -1:
    cdef long long l
    if type(layer) is not int and not _is_int(layer):
        raise TypeError(f"layer must be an int, got {type(layer).__name__}")
    try:
        l = PyLong_AsLongLong(layer) if type(layer) is int else int(layer)
    except OverflowError:
        l = -1
    if l < 0 or l >= core.num_layers:
        raise ValueError(f"layer {layer} out of range: the cache has {core.num_layers} layer(s)")
    return <int>l


cdef int64_t _batch_len(CacheCore core, object sids) except -1:
    """B = len(sids), checked: 1 <= B <= max_seqs."""
    cdef int64_t B
    try:
        B = len(sids)
    except TypeError:
        raise TypeError(f"sids must be a sequence of ints, got {type(sids).__name__}") from None
    if B < 1:
        raise ValueError("sids must name at least one sequence")
    if B > core.max_seqs:
        raise ValueError(f"{B} sequence ids given; the cache holds at most {core.max_seqs}")
    return B


cdef int64_t _batch_seqs(CacheCore core, object sids) except -1:
    """Fill core.b_seqs from a sequence of distinct ids; return B."""
    cdef int64_t B = _batch_len(core, sids), i, slot
    cdef Seq *s
    core.mark += 1
    for i in range(B):
        s = core.seqs.lookup(sids[i])
        slot = core.seqs.slot_of(s)
        if core.b_mark[slot] == core.mark:
            raise ValueError(f"sequence id {sids[i]!r} appears twice in sids")
        core.b_mark[slot] = core.mark
        core.b_seqs[i] = s
    return B


cdef int _check_layer_append(const Seq *s, int layer, int64_t n) except -1:
    cdef int64_t total = s.segs.b1 + s.off1
    if n != s.step_n:
        if s.step_n == 0:
            raise ValueError(
                f"append on layer {layer} before any layer-0 append of this step: "
                "append layer 0 first")
        raise ValueError(
            f"append on layer {layer} must carry the n={s.step_n} tokens of the "
            f"newest layer-0 append, got n={n}")
    if n > s.segs.b1 - s.segs.b0:  # (trim resets step_n when it cuts into the step)
        raise ValueError(
            f"append on layer {layer}: the newest layer-0 step (n={n}) is no longer held "
            "in full: append a new step on layer 0")
    if s.written[layer] < total - n:
        raise ValueError(
            f"layer {layer} missed an earlier step of this sequence: it is written up to "
            f"position {s.written[layer]}, the step starts at {total - n}")
    return 0


cdef int _check_step_done(const Seq *s, object sid, int num_layers, str what) except -1:
    """Raise unless every layer holds the newest step (export and trim move or copy
    whole sequences: a pending layer append would land out of place)."""
    cdef int64_t total = s.segs.b1 + s.off1
    cdef int l
    for l in range(num_layers):
        if s.written[l] != total:
            raise ValueError(
                f"cannot {what} sequence {sid} in the middle of a step: layer {l} lacks "
                "its newest tokens (append them on every layer first)")
    return 0


cdef int _check_attendable(CacheCore core, const Seq *s, int layer, int64_t n) except -1:
    cdef int64_t held = pkv_held(&s.segs)
    if held == 0:
        raise ValueError(f"sequence {s.sid} is empty: append before attend")
    if n > held:
        raise ValueError(f"{n} queries but the sequence holds only {held} tokens")
    if s.written[layer] != s.segs.b1 + s.off1:
        raise RuntimeError(
            f"layer {layer} of sequence {s.sid} lacks its newest tokens: "
            f"append them on layer {layer} before attend")
    if pkv_check_seq(s.table, s.nblk, &s.segs, core.block_size, core.pool.num_blocks) != 0:
        raise RuntimeError("internal error: inconsistent sequence metadata")
    return 0


# ----------------------------------------------------------------------------
# arrays in and out

cdef cnp.ndarray _as_array(object a, str name):
    """`a` as a NumPy array (TypeError naming `name` when NumPy cannot make one)."""
    if cnp.PyArray_Check(a):
        return <cnp.ndarray>a
    try:
        return np.asarray(a)
    except Exception as e:
        raise TypeError(f"{name} must be a float array, got {type(a).__name__}") from e


cdef object _input(CacheCore core, object a, str name, int64_t d0, int d1, int d2,
                   str d0name, bint convert=True):
    """Return `a` as a C-contiguous array of the cache dtype and shape (d0, d1, d2).

    d0 < 0 accepts any leading size >= 1.  Other float dtypes are
    converted, non-contiguous arrays copied; anything else raises.  With
    convert=False the checked array is returned as it is (_contiguous
    converts it once the call is known to proceed: a leading size no
    sequence can hold must not be copied first).
    """
    cdef cnp.ndarray arr
    cdef cnp.npy_intp *dims
    if cnp.PyArray_Check(a):
        arr = <cnp.ndarray>a
        if (cnp.PyArray_TYPE(arr) == core.typenum and cnp.PyArray_NDIM(arr) == 3
                and cnp.PyArray_ISCARRAY_RO(arr)):
            dims = cnp.PyArray_DIMS(arr)
            if ((dims[0] == d0 or (d0 < 0 and dims[0] >= 1))
                    and dims[1] == d1 and dims[2] == d2):
                return a
    else:
        arr = _as_array(a, name)
    _check_kind(core, arr, name)
    want = f"[{d0name}, {d1}, {d2}]" if d0 < 0 else f"[{d0name}={d0}, {d1}, {d2}]"
    if arr.ndim != 3:
        raise ValueError(f"{name} must have shape {want}, got {np.ndim(arr)}-d shape {np.shape(arr)}")
    dims = cnp.PyArray_DIMS(arr)
    if not ((dims[0] == d0 or (d0 < 0 and dims[0] >= 1)) and dims[1] == d1 and dims[2] == d2):
        raise ValueError(f"{name} must have shape {want}, got {np.shape(arr)}")
    return _contiguous(core, arr) if convert else arr


cdef int _check_kind(CacheCore core, object arr, str name) except -1:
    """Raise unless arr's dtype converts to the cache's arrays' dtype."""
    dt = arr.dtype
    if dt == core.np_dtype:
        return 0
    if core.raw16:
        raise TypeError(f"{name} must be a uint16 array of {core.dtype_name} bit patterns "
                        f"(the cache was made with raw16=True), got dtype {dt}")
    if dt.kind != "f" and not (core.io == PKV_BF16 and dt.name == "bfloat16"):
        raise TypeError(f"{name} must be a float array (float16/32/64), got dtype {dt}")
    return 0


cdef inline object _contiguous(CacheCore core, object a):
    """A checked input array as a C-contiguous array of the cache dtype."""
    if (cnp.PyArray_TYPE(<cnp.ndarray>a) == core.typenum
            and cnp.PyArray_ISCARRAY_RO(<cnp.ndarray>a)):
        return a
    # ALIGNED too: np.ascontiguousarray passes an unaligned C-contiguous
    # array through (e.g. from a byte buffer at an odd offset), and the C
    # code loads whole floats
    return np.require(a, core.np_dtype, ("C_CONTIGUOUS", "ALIGNED"))


cdef object _output(CacheCore core, object out, int64_t n, int hq):
    cdef cnp.ndarray arr
    if out is None:
        return cnp.PyArray_EMPTY(3, [n, hq, core.head_dim], core.typenum, 0)
    if not cnp.PyArray_Check(out):
        raise TypeError(f"out must be a numpy array, got {type(out).__name__}")
    arr = <cnp.ndarray>out
    if cnp.PyArray_TYPE(arr) != core.typenum:
        raise TypeError(f"out must have dtype {core.dtype}, got {arr.dtype}")
    if (cnp.PyArray_NDIM(arr) != 3 or cnp.PyArray_DIMS(arr)[0] != n
            or cnp.PyArray_DIMS(arr)[1] != hq or cnp.PyArray_DIMS(arr)[2] != core.head_dim):
        raise ValueError(f"out must have shape [{n}, {hq}, {core.head_dim}], got {np.shape(arr)}")
    if not cnp.PyArray_ISCARRAY(arr):
        raise ValueError("out must be C-contiguous, aligned and writable")
    return out


cdef object _query(CacheCore core, object q, int64_t d0, str d0name, int *hq_out,
                   bint convert=True):
    """q as a C-contiguous [d0, Hq, D] array of the cache dtype; Hq into hq_out
    (convert=False: checked, not converted; see _input)."""
    cdef int hq
    if not cnp.PyArray_Check(q):
        q = _as_array(q, "q")
    if cnp.PyArray_TYPE(q) != core.typenum:
        _check_kind(core, q, "q")
    if cnp.PyArray_NDIM(q) != 3:
        raise ValueError(
            f"q must have shape [{d0name}, Hq, {core.head_dim}], got shape {np.shape(q)}")
    hq = <int>cnp.PyArray_DIMS(q)[1]
    if hq < 1 or hq % core.num_kv_heads != 0:
        raise ValueError(
            f"q has {hq} heads; the number of query heads must be a positive "
            f"multiple of num_kv_heads={core.num_kv_heads}")
    hq_out[0] = hq
    return _input(core, q, "q", d0, hq, core.head_dim, d0name, convert)


# ----------------------------------------------------------------------------
# attention arguments

cdef double _scale(CacheCore core, object scale) except? -1:
    cdef double s
    if scale is None:
        return 1.0 / sqrt(<double>core.head_dim)
    s = _number(scale, "scale", "None or a number")
    if not isfinite(s):
        raise ValueError(f"scale must be finite, got {scale}")
    return s


cdef object _options(object window, object softcap, object sinks, int hq):
    """(window, softcap, sinks as float64 [hq]) checked, or None when all are off."""
    if window is None and softcap is None and sinks is None:
        return None
    cdef int64_t w = 0
    cdef double c = 0.0
    if window is not None:
        if not _is_int(window):
            raise TypeError(f"window must be None or an int >= 1, got "
                            f"{type(window).__name__}")
        if not 1 <= window < 2**62:
            raise ValueError(f"window must be None or an int >= 1, got {window}")
        w = window
    if softcap is not None:
        c = _number(softcap, "softcap", "None or a number > 0")
        if not (c > 0 and c < float("inf")):
            raise ValueError(f"softcap must be None or a finite number > 0, got {softcap}")
    if sinks is not None:
        if not isinstance(sinks, np.ndarray):
            raise TypeError(f"sinks must be None or a float32/float64 NumPy array of shape "
                            f"[{hq}] (one logit per query head), got {type(sinks).__name__}")
        if sinks.dtype not in (np.float32, np.float64):
            raise TypeError(f"sinks must be float32 or float64, got {sinks.dtype}")
        if sinks.shape != (hq,):
            raise ValueError(f"sinks must have shape ({hq},) (one logit per query head), "
                             f"got {sinks.shape}")
        sinks = np.ascontiguousarray(sinks, dtype=np.float64)
        if not np.isfinite(sinks).all():
            raise ValueError("sinks must be finite")
    return (w, c, sinks)
