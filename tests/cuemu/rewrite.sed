# rewrite.sed — turns each CUDA launch `kernel<<<cfg>>>(` of a kernels/cuda
# file into `tt_emu_launch("kernel", kernel, cfg)(` (cuemu_device.h), so the
# file compiles as C++. A launch's `<<<...>>>(` must sit on one line, which
# holds for every launch in the tree (CMake fails the build otherwise:
# a leftover `<<<` does not compile).
s/([A-Za-z_][A-Za-z_0-9:]*(<[^<>;]*>)?)<<<(.*)>>>\(/tt_emu_launch("\1", \1, \3)(/g
