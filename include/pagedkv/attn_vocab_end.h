/* pagedkv/attn_vocab_end.h -- undefine one (compute type, ISA) vocabulary
 * (vocab_*.h) and its PKV_T_F64, after attention.h has instantiated it.  No
 * include guard on purpose. */
#undef PKV_VEC
#undef PKV_W
#undef PKV_VLOAD
#undef PKV_VSTORE
#undef PKV_VSET1
#undef PKV_VZERO
#undef PKV_VADD
#undef PKV_VSUB
#undef PKV_VMUL
#undef PKV_VDIV
#undef PKV_VMAX
#undef PKV_VMIN
#undef PKV_VFMA
#undef PKV_VREDUCE
#undef PKV_VHMAX
#undef PKV_SC_NV
#undef PKV_PV_NV
#undef PKV_VROUND
#undef PKV_VSCALE2K
#undef PKV_VFRAC
#undef PKV_VSCALE2FL
#undef PKV_LD_F32
#undef PKV_LD_BF16
#undef PKV_LD_F16
#undef PKV_LD_I8
#undef PKV_LD_BF16_PAIR
#undef PKV_VEVEN
#undef PKV_VODD
#undef PKV_VILO
#undef PKV_VIHI
#undef PKV_T
#undef PKV_T_F64
#undef PKV_TAG
