// FY_CLONES: a loop compiled once per instruction set and picked at run time (GCC function
// multiversioning). The library is built for baseline x86-64, so this is how one binary runs
// AVX-512 or AVX2 code where the CPU has it.
//
// The AVX2 clone is x86-64-v3 (AVX2 with FMA, F16C, BMI): a plain "avx2" clone leaves FMA
// out, and then every fmaf of kernels/common/element_math.h is a libm call and the exp,
// GELU and softmax loops run scalar (on a Zen 3 at the default shape, over a third of the
// training step's samples were GELU, softmax and libm's fmaf). Those loops also need GCC's
// -fno-tree-pre in the files that hold them (CMakeLists.txt says why).
#pragma once

#define FY_CLONES __attribute__((target_clones("avx512f", "arch=x86-64-v3", "default")))
