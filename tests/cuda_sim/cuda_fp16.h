// Test-only stand-in for CUDA's <cuda_fp16.h>: the types live in cuda_sim.h.
#pragma once
#include "cuda_sim.h"
