"""What the runtime is checked against, kept out of it: the float64 attention of a step (`attention`) and
synthetic batches over a real pool (`synthetic`), used by the tests and by the kernel race's oracle."""
