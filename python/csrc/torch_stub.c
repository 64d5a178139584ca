/* An empty shared library standing in for one of torch's (libtorch_cpu.so, libc10.so,
 * libc10_cuda.so) when the extension is built against a torch's headers alone: linking it
 * records the library's name as a dependency of _C.so, and at load time the dynamic loader
 * resolves that name to the torch library the importing python3 has already loaded. */
int spind_torch_stub;
