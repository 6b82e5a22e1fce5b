"""CPU fast paths: the C++ kernels (built at run time through kernel_build), oneDNN-packed linear layers, the fused layer ops."""
