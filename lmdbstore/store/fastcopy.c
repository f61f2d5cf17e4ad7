/* lmdbstore.store.fastcopy: copies out of a read-only file map into a numpy array, one call per batch.
 *
 * copy(dst, at, src, size, offs, lens) copies lens[i] bytes (or lens bytes for every i, when lens is an int)
 * from address src + offs[i] to dst[at[i]:].  It checks every range against the map's size and the
 * destination's length first (ValueError otherwise: nothing is copied), releases the GIL while it copies, and
 * survives SIGBUS: a page that cannot be touched ends the copy, and copy() says whose page it was, by the
 * fault's address, instead of the process dying: COPIED (every byte), SOURCE (a page of the map past the end of
 * its file: another process shrank it), DEST (a page of dst: an out= that maps a truncated file, a full tmpfs
 * under a shared-memory segment), OTHER (neither), or UNPROTECTED (nothing copied: see below).
 *
 * The program's SIGBUS handler stays the program's: the copier's handler is installed only while a copy runs
 * (the first of concurrent copies installs it, the last puts back the handler that was there, exactly) and
 * chains to that handler for a SIGBUS that is not a copy's (another thread's own map), or ends the process as
 * the default action would.  It never saves itself as "previous" and never installs itself over a handler that
 * was installed over it during a copy (faulthandler.enable() on another thread meanwhile: that handler chains
 * back to the copier's, and installing the copier's over it again made the two call each other for ever);
 * until that handler is gone, copy() answers UNPROTECTED and the caller copies without it (process_vm_readv).
 * Cost: four sigaction calls per copy (about a microsecond), none per byte.
 * It is the optional compiled part of lmdbstore: without it, the library copies with numpy under a read lease,
 * or with process_vm_readv (lmdbstore.store.copies).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>

#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 4
#endif

enum { COPIED = 0, SOURCE = 1, DEST = 2, OTHER = 3, UNPROTECTED = 4 };

/* A signal's disposition exactly as the kernel holds it, where the kernel's struct is known (x86-64, aarch64): saved
 * and put back with the raw system call, so that the program finds every field as it left it (libc's sigaction()
 * would add its own restorer to a disposition that never had one).  Elsewhere libc's struct sigaction. */
#if defined(__linux__) && (defined(__x86_64__) || defined(__aarch64__))
#include <sys/syscall.h>
#include <unistd.h>
typedef struct {
    void *handler;
    unsigned long flags;
    void *restorer;
    uint64_t mask;
} disp_t;
static int get_disp(disp_t *d) { return (int)syscall(SYS_rt_sigaction, SIGBUS, NULL, d, sizeof d->mask); }
static int set_disp(const disp_t *d) { return (int)syscall(SYS_rt_sigaction, SIGBUS, d, NULL, sizeof d->mask); }
static void *disp_handler(const disp_t *d) { return d->handler; }
static int disp_siginfo(const disp_t *d) { return (d->flags & SA_SIGINFO) != 0; }
#else
typedef struct sigaction disp_t;
static int get_disp(disp_t *d) { return sigaction(SIGBUS, NULL, d); }
static int set_disp(const disp_t *d) { return sigaction(SIGBUS, d, NULL); }
static void *disp_handler(const disp_t *d) {
    return (d->sa_flags & SA_SIGINFO) ? (void *)d->sa_sigaction : (void *)d->sa_handler;
}
static int disp_siginfo(const disp_t *d) { return (d->sa_flags & SA_SIGINFO) != 0; }
#endif

static __thread __attribute__((tls_model("initial-exec"))) sigjmp_buf *volatile current_jump;
static __thread __attribute__((tls_model("initial-exec"))) void *volatile fault_addr;
static disp_t previous;     /* the disposition present when ours was installed (never ours) */
static int copies_running; /* copies in progress, under install_lock */
static int foreign;        /* a handler was installed over ours during a copy: it may chain to ours */
static pthread_mutex_t install_lock = PTHREAD_MUTEX_INITIALIZER;

static void on_sigbus(int sig, siginfo_t *info, void *ctx);

static int is_ours(const disp_t *d) { return disp_siginfo(d) && disp_handler(d) == (void *)on_sigbus; }

static int is_plain(const disp_t *d) { /* SIG_DFL or SIG_IGN: chains to nobody */
    return !disp_siginfo(d) && (disp_handler(d) == (void *)SIG_DFL || disp_handler(d) == (void *)SIG_IGN);
}

/* What would have happened without the copier's handler: the previous handler runs, or the default action. */
static void chain(int sig, siginfo_t *info, void *ctx) {
    void *h = disp_handler(&previous);
    int sent = info != NULL && info->si_code <= 0; /* kill(), sigqueue(), tgkill(): not a fault */
    if (disp_siginfo(&previous)) {
        ((void (*)(int, siginfo_t *, void *))h)(sig, info, ctx);
        return;
    }
    if (h != (void *)SIG_DFL && h != (void *)SIG_IGN) {
        ((void (*)(int))h)(sig);
        return;
    }
    if (h == (void *)SIG_IGN && sent) return; /* ignored, as it was (a fault cannot be ignored) */
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, NULL); /* the process ends: a fault runs again under the default action */
    if (sent) raise(sig);
}

static void on_sigbus(int sig, siginfo_t *info, void *ctx) {
    sigjmp_buf *jump = current_jump;
    if (jump != NULL) {
        current_jump = NULL;
        fault_addr = info != NULL ? info->si_addr : NULL;
        siglongjmp(*jump, 1);
    }
    chain(sig, info, ctx); /* not one of ours */
}

/* Before a copy: 0 with the copier's handler installed (the first copy installs it), UNPROTECTED when it must not
 * be (see the top), -1 on error (errno). */
static int enter(void) {
    int rc = 0;
    pthread_mutex_lock(&install_lock);
    if (copies_running == 0) {
        disp_t now;
        struct sigaction ours;
        memset(&ours, 0, sizeof ours);
        ours.sa_sigaction = on_sigbus;
        ours.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK; /* NODEFER: siglongjmp leaves SIGBUS unblocked */
        sigemptyset(&ours.sa_mask);
        if (get_disp(&now) != 0) {
            rc = -1;
        } else if (is_ours(&now)) {
            foreign = 0; /* put back by the handler that was over it: `previous` is still the one before ours */
        } else if (foreign && !is_plain(&now)) {
            rc = UNPROTECTED;
        } else if (sigaction(SIGBUS, &ours, NULL) != 0) {
            rc = -1;
        } else {
            previous = now;
            foreign = 0;
        }
    }
    if (rc == 0) copies_running++;
    pthread_mutex_unlock(&install_lock);
    return rc;
}

/* After a copy: the last one puts back the handler that was there, unless another was installed over ours. */
static void leave(void) {
    pthread_mutex_lock(&install_lock);
    if (--copies_running == 0) {
        disp_t now;
        if (get_disp(&now) == 0) {
            if (is_ours(&now))
                set_disp(&previous);
            else
                foreign = 1;
        }
    }
    pthread_mutex_unlock(&install_lock);
}

/* A contiguous int64 array's data and length, from any object exporting a buffer of 8-byte items. */
static int int64_buffer(PyObject *obj, Py_buffer *view, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) return -1;
    if (view->itemsize != 8 || view->format == NULL || (strcmp(view->format, "q") != 0 && strcmp(view->format, "l") != 0 &&
                                                        strcmp(view->format, "<q") != 0 && strcmp(view->format, "<l") != 0)) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous int64 array", name);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Copy every run; 0 when done, 1 when a SIGBUS ended it (its address in fault_addr).  The first and last cache
 * lines of the run PREFETCH_AHEAD runs ahead are asked for early: a random gather waits on memory (and on the page
 * walks of the two pages a sample may span) more than it copies. */
static int copy_runs(char *dst, const int64_t *at, const char *src, const int64_t *offs, const int64_t *lens,
                     int64_t width, Py_ssize_t n) {
    sigjmp_buf jump;
    if (sigsetjmp(jump, 0) != 0) return 1;
    current_jump = &jump;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n) {
            Py_ssize_t j = i + PREFETCH_AHEAD;
            int64_t len = lens ? lens[j] : width;
            if (len > 0) {
                __builtin_prefetch(src + offs[j]);
                __builtin_prefetch(src + offs[j] + len - 1);
            }
        }
        memcpy(dst + at[i], src + offs[i], (size_t)(lens ? lens[i] : width));
    }
    current_jump = NULL;
    return 0;
}

static PyObject *fastcopy_copy(PyObject *self, PyObject *args) {
    PyObject *dst_obj, *at_obj, *offs_obj, *lens_obj;
    unsigned long long src_addr;
    long long size;
    if (!PyArg_ParseTuple(args, "OOKLOO:copy", &dst_obj, &at_obj, &src_addr, &size, &offs_obj, &lens_obj)) return NULL;
    Py_buffer dst = {0}, at = {0}, offs = {0}, lens = {0};
    int have_lens = 0;
    int64_t width = 0;
    PyObject *result = NULL;
    if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) return NULL;
    if (int64_buffer(at_obj, &at, "at") != 0) goto done_dst;
    if (int64_buffer(offs_obj, &offs, "offs") != 0) goto done_at;
    if (PyLong_Check(lens_obj)) {
        width = PyLong_AsLongLong(lens_obj);
        if (width == -1 && PyErr_Occurred()) goto done_offs;
        if (width < 0) {
            PyErr_SetString(PyExc_ValueError, "lens must not be negative");
            goto done_offs;
        }
    } else {
        if (int64_buffer(lens_obj, &lens, "lens") != 0) goto done_offs;
        have_lens = 1;
    }
    Py_ssize_t n = at.len / 8;
    if (offs.len / 8 != n || (have_lens && lens.len / 8 != n)) {
        PyErr_SetString(PyExc_ValueError, "at, offs and lens must have the same length");
        goto done_lens;
    }
    const int64_t *a = at.buf, *o = offs.buf, *l = have_lens ? lens.buf : NULL;
    for (Py_ssize_t i = 0; i < n; i++) { /* every range inside the map and the destination: never a wild copy */
        int64_t len = l ? l[i] : width;
        if (len < 0 || o[i] < 0 || a[i] < 0 || o[i] > size - len || a[i] > (int64_t)dst.len - len) {
            PyErr_Format(PyExc_ValueError, "run %zd (%lld bytes from %lld to %lld) lies outside the map or dst", i,
                         (long long)len, (long long)o[i], (long long)a[i]);
            goto done_lens;
        }
    }
    int status = enter();
    if (status < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        goto done_lens;
    }
    if (status == 0) {
        const char *s0 = (const char *)(uintptr_t)src_addr;
        int bus;
        Py_BEGIN_ALLOW_THREADS
        bus = copy_runs(dst.buf, a, s0, o, l, width, n);
        leave();
        Py_END_ALLOW_THREADS
        if (bus) { /* whose page: by the fault's address */
            const char *at_fault = (const char *)fault_addr, *d0 = (const char *)dst.buf;
            if (at_fault >= s0 && at_fault < s0 + size)
                status = SOURCE;
            else if (at_fault >= d0 && at_fault < d0 + dst.len)
                status = DEST;
            else
                status = OTHER;
        }
    }
    result = PyLong_FromLong(status);
done_lens:
    if (have_lens) PyBuffer_Release(&lens);
done_offs:
    PyBuffer_Release(&offs);
done_at:
    PyBuffer_Release(&at);
done_dst:
    PyBuffer_Release(&dst);
    return result;
}

/* A contiguous buffer of items of itemsize bytes (any format), read-only. */
static int raw_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS) != 0) return -1;
    if (view->itemsize != itemsize) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous array of %zd-byte items", name, itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* locate(idx, offsets, checked, spv, sb, out) -> int: out[i] = offsets[v] + (idx[i] - v * spv) * sb for
 * v = idx[i] // spv (every idx[i] in range of the table: the caller checked); -1 when done, else the first i
 * whose value is not checked (checked[v] == 0) or has no offset (offsets[v] < 0): nothing is promised of out. */
static PyObject *fastcopy_locate(PyObject *self, PyObject *args) {
    PyObject *idx_obj, *offsets_obj, *checked_obj, *out_obj;
    long long spv, sb;
    if (!PyArg_ParseTuple(args, "OOOLLO:locate", &idx_obj, &offsets_obj, &checked_obj, &spv, &sb, &out_obj)) return NULL;
    Py_buffer idx = {0}, offsets = {0}, checked = {0}, out = {0};
    PyObject *result = NULL;
    if (spv < 1 || sb < 0) {
        PyErr_SetString(PyExc_ValueError, "spv must be positive and sb not negative");
        return NULL;
    }
    if (int64_buffer(idx_obj, &idx, "idx") != 0) return NULL;
    if (int64_buffer(offsets_obj, &offsets, "offsets") != 0) goto done_idx;
    if (raw_buffer(checked_obj, &checked, 1, "checked") != 0) goto done_offsets;
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) goto done_checked;
    Py_ssize_t n = idx.len / 8, nv = offsets.len / 8;
    if (out.len < idx.len || checked.len != nv) {
        PyErr_SetString(PyExc_ValueError, "out must hold idx, and checked have one entry per offset");
        goto done_out;
    }
    const int64_t *ix = idx.buf, *off = offsets.buf;
    const unsigned char *ok = checked.buf;
    int64_t *o = out.buf;
    Py_ssize_t bad = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t k = ix[i];
        if (k < 0 || k / spv >= nv) {
            PyErr_Format(PyExc_IndexError, "sample %lld outside the table", (long long)k);
            goto done_out;
        }
        int64_t v = k / spv;
        if (!ok[v] || off[v] < 0) {
            bad = i;
            break;
        }
        o[i] = off[v] + (k - v * spv) * sb;
    }
    result = PyLong_FromSsize_t(bad);
done_out:
    PyBuffer_Release(&out);
done_checked:
    PyBuffer_Release(&checked);
done_offsets:
    PyBuffer_Release(&offsets);
done_idx:
    PyBuffer_Release(&idx);
    return result;
}

/* known(pages, offs, width, shift) -> bool: whether pages[p] is non-zero for every page p of every run
 * [offs[i], offs[i] + width) (p = byte >> shift; the runs inside the page map). */
static PyObject *fastcopy_known(PyObject *self, PyObject *args) {
    PyObject *pages_obj, *offs_obj;
    long long width, shift;
    if (!PyArg_ParseTuple(args, "OOLL:known", &pages_obj, &offs_obj, &width, &shift)) return NULL;
    if (width < 1 || shift < 0 || shift > 40) {
        PyErr_SetString(PyExc_ValueError, "width must be positive and shift in 0..40");
        return NULL;
    }
    Py_buffer pages = {0}, offs = {0};
    PyObject *result = NULL;
    if (raw_buffer(pages_obj, &pages, 1, "pages") != 0) return NULL;
    if (int64_buffer(offs_obj, &offs, "offs") != 0) goto done_pages;
    const unsigned char *pg = pages.buf;
    const int64_t *o = offs.buf;
    Py_ssize_t n = offs.len / 8;
    int all = 1;
    for (Py_ssize_t i = 0; i < n && all; i++) {
        int64_t p0 = o[i] >> shift, p1 = (o[i] + width - 1) >> shift;
        if (o[i] < 0 || p1 >= pages.len) {
            PyErr_Format(PyExc_ValueError, "run %zd lies outside the page map", i);
            goto done_offs;
        }
        for (int64_t p = p0; p <= p1; p++) {
            if (!pg[p]) {
                all = 0;
                break;
            }
        }
    }
    result = PyBool_FromLong(all);
done_offs:
    PyBuffer_Release(&offs);
done_pages:
    PyBuffer_Release(&pages);
    return result;
}

static PyMethodDef methods[] = {
    {"copy", fastcopy_copy, METH_VARARGS,
     "copy(dst, at, src, size, offs, lens) -> int: copy lens[i] (or lens) bytes from address src + offs[i] of a "
     "map of size bytes into dst[at[i]:], the GIL released: COPIED, or whose page a SIGBUS ended it on (SOURCE, "
     "DEST, OTHER), or UNPROTECTED (nothing copied: another SIGBUS handler was installed over the copier's)."},
    {"locate", fastcopy_locate, METH_VARARGS,
     "locate(idx, offsets, checked, spv, sb, out) -> int: each sample's file offset into out; -1, or the first "
     "sample whose value is unchecked or has no offset."},
    {"known", fastcopy_known, METH_VARARGS,
     "known(pages, offs, width, shift) -> bool: whether the page map marks every page of every run."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "fastcopy", "Copies out of a file map (see copy).", -1,
                                    methods};

PyMODINIT_FUNC PyInit_fastcopy(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "COPIED", COPIED) || PyModule_AddIntConstant(m, "SOURCE", SOURCE) ||
        PyModule_AddIntConstant(m, "DEST", DEST) || PyModule_AddIntConstant(m, "OTHER", OTHER) ||
        PyModule_AddIntConstant(m, "UNPROTECTED", UNPROTECTED)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
