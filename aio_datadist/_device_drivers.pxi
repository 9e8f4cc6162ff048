# _device_drivers.pxi: included by _core.pyx (one module; each .pxi holds one part of it).
# --------------------------------------------------------------------------
# Device drivers, loaded at run time
#
# Nothing here needs a device toolkit to build: the entry points are looked up
# with dlsym in the driver library the machine has. A machine without the
# library (or without a device) gets OSError(ENODEV) with a message that
# names what is missing; a driver call that fails gets OSError(EIO).

cdef void *_open_library(str library, str missing) except NULL:
    cdef bytes name = library.encode()
    cdef void *lib = dlopen(name, RTLD_NOW | RTLD_LOCAL)
    if lib == NULL:
        why = dlerror()
        detail = why.decode(errors="replace") if why != NULL else "not found"
        raise OSError(ENODEV, f"{library} not found: {missing} (dlopen: {detail})")
    return lib


cdef void *_symbol(void *lib, str library, str name, bint required, str needs) except? NULL:
    cdef bytes raw = name.encode()
    cdef void *fn = dlsym(lib, raw)
    if fn == NULL and required:
        raise OSError(ENODEV, f"{library} has no {name}: {needs}")
    return fn


_drivers = {}


def cuda_driver(str library="libcuda.so.1"):
    """The process's :class:`CudaDriver` for ``library`` (loaded once, never unloaded)."""
    drv = _drivers.get(("cuda", library))
    if drv is None:
        drv = CudaDriver(library)
        _drivers[("cuda", library)] = drv
    return drv


def acl_driver(str library="libascendcl.so"):
    """The process's :class:`AclDriver` for ``library`` (loaded once, never unloaded)."""
    drv = _drivers.get(("npu", library))
    if drv is None:
        drv = AclDriver(library)
        _drivers[("npu", library)] = drv
    return drv


cdef class CudaDriver:
    """The CUDA driver API entry points the core uses, from ``libcuda.so.1``.

    Construction loads the library, resolves every symbol and runs
    ``cuInit``; use :func:`cuda_driver` to share one per process.
    """

    def __cinit__(self, str library="libcuda.so.1"):
        cdef CUresult rc
        needs = "the NVIDIA driver is too old (R525 / CUDA 12.0 or newer is needed)"
        self._library = library
        self._contexts = {}
        self._retains = {}
        self._lib = _open_library(library, "no NVIDIA driver is installed on this machine")
        self._init = <cuInit_t>_symbol(self._lib, library, "cuInit", True, needs)
        self._error_string = <cuGetErrorString_t>_symbol(self._lib, library, "cuGetErrorString", True, needs)
        self._error_name = <cuGetErrorName_t>_symbol(self._lib, library, "cuGetErrorName", True, needs)
        self._device_get = <cuDeviceGet_t>_symbol(self._lib, library, "cuDeviceGet", True, needs)
        self._device_count = <cuDeviceGetCount_t>_symbol(self._lib, library, "cuDeviceGetCount", True, needs)
        self._primary_retain = <cuDevicePrimaryCtxRetain_t>_symbol(
            self._lib, library, "cuDevicePrimaryCtxRetain", True, needs)
        self._ctx_push = <cuCtxPushCurrent_t>_symbol(self._lib, library, "cuCtxPushCurrent_v2", True, needs)
        self._ctx_pop = <cuCtxPopCurrent_t>_symbol(self._lib, library, "cuCtxPopCurrent_v2", True, needs)
        self._launch_host_func = <cuLaunchHostFunc_t>_symbol(self._lib, library, "cuLaunchHostFunc", True, needs)
        self._primary_release = <cuDevicePrimaryCtxRelease_t>_symbol(
            self._lib, library, "cuDevicePrimaryCtxRelease_v2", True, needs)
        self._is_capturing = <cuStreamIsCapturing_t>_symbol(self._lib, library, "cuStreamIsCapturing", True, needs)
        self._device_attribute = <cuDeviceGetAttribute_t>_symbol(
            self._lib, library, "cuDeviceGetAttribute", True, needs)
        self._host_device_pointer = <cuMemHostGetDevicePointer_t>_symbol(
            self._lib, library, "cuMemHostGetDevicePointer_v2", True, needs)
        self._batch_v2 = <cuMemcpyBatchAsync_v2_t>_symbol(self._lib, library, "cuMemcpyBatchAsync_v2", False, "")
        self._batch_v1 = <cuMemcpyBatchAsync_v1_t>_symbol(self._lib, library, "cuMemcpyBatchAsync", False, "")
        # Optional: without them a notifier posts by host function only.
        self._event_create = <cuEventCreate_t>_symbol(self._lib, library, "cuEventCreate", False, "")
        self._event_record = <cuEventRecord_t>_symbol(self._lib, library, "cuEventRecord", False, "")
        self._event_query = <cuEventQuery_t>_symbol(self._lib, library, "cuEventQuery", False, "")
        self._event_destroy = <cuEventDestroy_t>_symbol(self._lib, library, "cuEventDestroy_v2", False, "")
        with nogil:
            rc = self._init(0)
        if rc != CUDA_SUCCESS:
            raise OSError(ENODEV, f"cuInit failed: {self._describe(rc)}")

    cdef CUevent _recorded_event(self, CUstream stream) noexcept nogil:
        # A new event recorded on ``stream`` (the caller's context current), or NULL where the driver has no
        # events or refuses one.
        cdef CUevent event = NULL
        if self._event_create == NULL or self._event_create(&event, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS:
            return NULL
        if self._event_record(event, stream) != CUDA_SUCCESS:
            self._event_destroy(event)
            return NULL
        return event

    cdef str _describe(self, CUresult rc):
        cdef const char *name = NULL
        cdef const char *text = NULL
        self._error_name(rc, &name)
        self._error_string(rc, &text)
        n = name.decode(errors="replace") if name != NULL else f"CUresult {rc}"
        t = text.decode(errors="replace") if text != NULL else "unknown error"
        return f"{n} ({t})"

    cdef CUcontext _retain(self, int device) except? NULL:
        # The primary context (the one the CUDA runtime, and so torch, uses), retained once per user:
        # each _retain is matched by one _release, and the last release gives it back to the driver.
        cdef CUdevice dev
        cdef CUcontext ctx = NULL
        cdef CUresult rc
        cached = self._contexts.get(device)
        if cached is not None:
            self._retains[device] += 1
            return <CUcontext><size_t>cached
        rc = self._device_get(&dev, device)
        if rc != CUDA_SUCCESS:
            raise OSError(ENODEV, f"CUDA device {device}: {self._describe(rc)}")
        rc = self._primary_retain(&ctx, dev)
        if rc != CUDA_SUCCESS:
            raise OSError(EIO, f"cuDevicePrimaryCtxRetain({device}) failed: {self._describe(rc)}")
        self._contexts[device] = <size_t>ctx
        self._retains[device] = 1
        return ctx

    cdef void _release(self, int device):
        cdef CUdevice dev
        left = self._retains.get(device, 0) - 1
        if left < 0:
            return
        if left > 0:
            self._retains[device] = left
            return
        del self._retains[device]
        del self._contexts[device]
        if self._device_get(&dev, device) == CUDA_SUCCESS:
            self._primary_release(dev)

    def retain_context(self, int device):
        """Retain ``device``'s primary context for the caller (matched by :meth:`release_context`)."""
        self._retain(device)

    def release_context(self, int device):
        """Release one :meth:`retain_context`; the last one gives the context back to the driver."""
        self._release(device)

    def retained(self, int device):
        """How many users hold ``device``'s primary context through this driver object."""
        return self._retains.get(device, 0)

    def can_map_host(self, int device):
        """Whether kernels on ``device`` can use registered host memory at its host address."""
        cdef CUdevice dev
        cdef int value = 0
        if self._device_get(&dev, device) != CUDA_SUCCESS:
            return False
        if self._device_attribute(&value, CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, dev) != 0:
            return False
        return value != 0

    def host_device_pointer(self, int device, size_t address):
        """The device address of registered (mapped) host memory at ``address``; OSError(EIO) if unmapped."""
        cdef CUdeviceptr dptr = 0
        cdef CUcontext ctx, popped
        cdef CUresult rc
        ctx = self._retain(device)
        try:
            rc = self._ctx_push(ctx)
            if rc == CUDA_SUCCESS:
                rc = self._host_device_pointer(&dptr, <void *>address, 0)
                self._ctx_pop(&popped)
        finally:
            self._release(device)
        if rc != CUDA_SUCCESS:
            raise OSError(EIO, f"cuMemHostGetDevicePointer failed: {self._describe(rc)}")
        return dptr

    @property
    def library(self):
        return self._library

    @property
    def has_batch_copy(self):
        """Whether the driver offers ``cuMemcpyBatchAsync`` (CUDA 12.8+)."""
        return self._batch_v2 != NULL or self._batch_v1 != NULL

    def device_count(self):
        """Number of CUDA devices the driver sees."""
        cdef int n = 0
        cdef CUresult rc = self._device_count(&n)
        if rc != CUDA_SUCCESS:
            raise OSError(EIO, f"cuDeviceGetCount failed: {self._describe(rc)}")
        return n

    def error_text(self, int code):
        """``NAME (description)`` of a ``CUresult``."""
        return self._describe(code)

    def memcpy_batch(self, int device, size_t stream, const uint64_t[::1] dsts not None,
                     const uint64_t[::1] srcs not None, const uint64_t[::1] sizes not None):
        """Enqueue ``count`` copies on ``stream`` with one ``cuMemcpyBatchAsync``.

        The copies run in stream order after earlier work (source access
        order STREAM). Every pointer must be device memory or page-locked
        host memory that stays valid until the stream passes the copies.
        Returns the bytes enqueued. OSError(ENODEV) without batch copies,
        OSError(EIO) when the driver refuses.
        """
        cdef size_t n = dsts.shape[0], i
        cdef uint64_t total = 0
        cdef CUmemcpyAttributes attr
        cdef size_t attr_idx = 0, fail_idx = 0
        cdef CUcontext ctx, popped
        cdef CUresult rc
        if srcs.shape[0] != n or sizes.shape[0] != n:
            raise ValueError("dsts, srcs and sizes must have one entry per copy")
        if self._batch_v2 == NULL and self._batch_v1 == NULL:
            raise OSError(ENODEV, f"{self._library} has no cuMemcpyBatchAsync (CUDA 12.8 or newer is needed)")
        if stream == 0:
            raise ValueError("batch copies cannot use the legacy default stream (0)")
        if n == 0:
            return 0
        for i in range(n):
            total += sizes[i]
        ctx = self._retain(device)
        attr.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        attr.srcLocHint.type = 0
        attr.srcLocHint.id = 0
        attr.dstLocHint.type = 0
        attr.dstLocHint.id = 0
        attr.flags = CU_MEMCPY_FLAG_DEFAULT
        with nogil:
            rc = self._ctx_push(ctx)
            if rc == CUDA_SUCCESS:
                if self._batch_v2 != NULL:
                    rc = self._batch_v2(<CUdeviceptr *>&dsts[0], <CUdeviceptr *>&srcs[0], <size_t *>&sizes[0], n,
                                        &attr, &attr_idx, 1, <CUstream>stream)
                else:
                    rc = self._batch_v1(<CUdeviceptr *>&dsts[0], <CUdeviceptr *>&srcs[0], <size_t *>&sizes[0], n,
                                        &attr, &attr_idx, 1, &fail_idx, <CUstream>stream)
                self._ctx_pop(&popped)
        self._release(device)
        if rc != CUDA_SUCCESS:
            raise OSError(EIO, f"cuMemcpyBatchAsync of {n} copies failed: {self._describe(rc)}")
        return total


cdef class AclDriver:
    """The Ascend ACL runtime entry points the core uses, from ``libascendcl.so``."""

    def __cinit__(self, str library="libascendcl.so"):
        needs = "the CANN runtime is too old (aclrtLaunchCallback and report threads are needed)"
        self._library = library
        self._lib = _open_library(library, "no Ascend CANN runtime is installed or on LD_LIBRARY_PATH")
        self._launch_callback = <aclrtLaunchCallback_t>_symbol(self._lib, library, "aclrtLaunchCallback", True, needs)
        self._subscribe = <aclrtSubscribeReport_t>_symbol(self._lib, library, "aclrtSubscribeReport", True, needs)
        self._unsubscribe = <aclrtUnSubscribeReport_t>_symbol(self._lib, library, "aclrtUnSubscribeReport", True, needs)
        self._process_report = <aclrtProcessReport_t>_symbol(self._lib, library, "aclrtProcessReport", True, needs)
        self._get_context = <aclrtGetCurrentContext_t>_symbol(self._lib, library, "aclrtGetCurrentContext", True, needs)
        self._set_context = <aclrtSetCurrentContext_t>_symbol(self._lib, library, "aclrtSetCurrentContext", True, needs)
        self._recent_error = <aclGetRecentErrMsg_t>_symbol(self._lib, library, "aclGetRecentErrMsg", False, "")

    cdef str _describe(self, aclError rc):
        cdef const char *msg = NULL
        if self._recent_error != NULL:
            msg = self._recent_error()
        detail = msg.decode(errors="replace") if msg != NULL else "no detail"
        return f"aclError {rc} ({detail})"

    @property
    def library(self):
        return self._library
