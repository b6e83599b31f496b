// mkDataType_t values as the kernels see them (numbered as NCCL numbers them; the Rust
// enum in src/types.rs is the source, and a Rust test checks these numbers against it).
#pragma once
#define MK_DTYPE_INT8 0
#define MK_DTYPE_UINT8 1
#define MK_DTYPE_INT32 2
#define MK_DTYPE_UINT32 3
#define MK_DTYPE_INT64 4
#define MK_DTYPE_UINT64 5
#define MK_DTYPE_FLOAT16 6
#define MK_DTYPE_FLOAT32 7
#define MK_DTYPE_FLOAT64 8
#define MK_DTYPE_BFLOAT16 9
