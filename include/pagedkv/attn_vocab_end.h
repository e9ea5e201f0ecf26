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
#undef VMAX
#undef VMIN
#undef VFMA
#undef VREDUCE
#undef VROUND
#undef VSCALE2K
#undef T
#undef PKV_F64
#undef PKV_TAG
