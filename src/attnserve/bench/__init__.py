"""Measurements on this machine: the kernel race (`bench kernels`), the tune race, serving load (`bench serve`)."""
