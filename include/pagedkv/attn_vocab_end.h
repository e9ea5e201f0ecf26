/* pagedkv/attn_vocab_end.h -- undefine one (compute type, ISA) vocabulary
 * (see attention.h).  No include guard on purpose. */
#undef VEC
#undef W
#undef VLOAD
#undef VSTORE
#undef VSET1
#undef VZERO
#undef VADD
#undef VSUB
#undef VMUL
#undef VDIV
#undef VMAX
#undef VMIN
#undef VFMA
#undef VREDUCE
#undef VHMAX
#undef PKV_SC_NV
#undef PKV_PV_NV
#undef VROUND
#undef VSCALE2K
#undef LD_F32
#undef LD_BF16
#undef LD_F16
#undef LD_I8
#undef T
#undef PKV_F64
#undef PKV_TAG
