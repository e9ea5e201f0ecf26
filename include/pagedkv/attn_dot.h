/* pagedkv/attn_dot.h -- dot products of query rows (compute type T) with
 * keys of type KT, loaded W at a time by KLOAD and one at a time by KGET.
 * Included by attn_math.h for keys in the compute type and by attn_impl.h
 * for keys in a storage type that differs from it.  No include guard on
 * purpose: the includer defines KT, KLOAD, KGET and DOTFN, undefined below.
 */

static inline T DOTFN(dot)(const T *restrict a, const KT *restrict b, int d) {
    int i = 0;
    T s = 0;
    if (d >= 2 * W) {
        VEC s0 = VZERO(), s1 = VZERO();
        for (; i + 2 * W <= d; i += 2 * W) {
            s0 = VFMA(VLOAD(a + i), KLOAD(b + i), s0);
            s1 = VFMA(VLOAD(a + i + W), KLOAD(b + i + W), s1);
        }
        s = VREDUCE(VADD(s0, s1));
    }
    for (; i + W <= d; i += W) s += VREDUCE(VMUL(VLOAD(a + i), KLOAD(b + i)));
    for (; i < d; i++) s += a[i] * KGET(b + i);
    return s;
}

/* Dot products of two keys k0, k1 with four query rows q0..q3 (8 chains):
 * each q vector is loaded once per two keys and each k vector once per four
 * rows.  out[r * 2 + j] = q_r . k_j */
static inline void DOTFN(dot4x2)(const T *restrict q0, const T *restrict q1,
                                 const T *restrict q2, const T *restrict q3,
                                 const KT *restrict k0, const KT *restrict k1, int d, T *out) {
    int i = 0;
    T t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (d >= W) {
        VEC a0 = VZERO(), a1 = VZERO(), a2 = VZERO(), a3 = VZERO();
        VEC b0 = VZERO(), b1 = VZERO(), b2 = VZERO(), b3 = VZERO();
        for (; i + W <= d; i += W) {
            const VEC x = KLOAD(k0 + i), y = KLOAD(k1 + i);
            VEC qv = VLOAD(q0 + i);
            a0 = VFMA(qv, x, a0);
            b0 = VFMA(qv, y, b0);
            qv = VLOAD(q1 + i);
            a1 = VFMA(qv, x, a1);
            b1 = VFMA(qv, y, b1);
            qv = VLOAD(q2 + i);
            a2 = VFMA(qv, x, a2);
            b2 = VFMA(qv, y, b2);
            qv = VLOAD(q3 + i);
            a3 = VFMA(qv, x, a3);
            b3 = VFMA(qv, y, b3);
        }
        t[0] = VREDUCE(a0);
        t[1] = VREDUCE(b0);
        t[2] = VREDUCE(a1);
        t[3] = VREDUCE(b1);
        t[4] = VREDUCE(a2);
        t[5] = VREDUCE(b2);
        t[6] = VREDUCE(a3);
        t[7] = VREDUCE(b3);
    }
    for (; i < d; i++) {
        const T x = KGET(k0 + i), y = KGET(k1 + i);
        t[0] += q0[i] * x;
        t[1] += q0[i] * y;
        t[2] += q1[i] * x;
        t[3] += q1[i] * y;
        t[4] += q2[i] * x;
        t[5] += q2[i] * y;
        t[6] += q3[i] * x;
        t[7] += q3[i] * y;
    }
    for (int r = 0; r < 8; r++) out[r] = t[r];
}

#undef KT
#undef KLOAD
#undef KGET
#undef DOTFN
