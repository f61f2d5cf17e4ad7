/* lmdbstore.store._batchread: the compiled read path of lmdbstore (lmdbstore/store/fileread.py drives it).
 *
 * read() does one whole batch with the GIL released: from the sample indices and the position table it cuts the
 * batch into runs (consecutive samples of one value whose rows are consecutive), copies the runs whose pages are
 * cached from the read-only map of the data file, and reads the others with preadv on a pool of threads of its own
 * (`threads` reads in flight).  A value read for the first time is read from its overflow header on, in the same
 * read, and the header is checked before the batch returns; a run of at least `extend` samples that is not cached
 * is read with the rest of its value (thrown away, but cached for the value's next pieces).  Which pages are
 * cached, the kernel says: a page map (one byte per page) trusted without a system call until a copy from the map
 * takes a major fault, the runs read otherwise (first by preadv2(RWF_NOWAIT): only what the page cache holds), and
 * trusted again after one mincore() over the whole file once a batch was wholly cached and the probes since cost as
 * much (a ski-rental rule).  Only speed depends on those answers: a page that left the cache costs a fault.
 *
 * SIGBUS: a page of a map past the end of a file shrunk under it faults.  A copy from the map catches it
 * (sigsetjmp) and read() says whose page it was by the fault's address (SOURCE: the map's; DEST: the destination's).
 * liblmdb's own reads of its map are guarded too (lmdb_begin/lmdb_end around them): a fault there gets a page of
 * zeros mapped over it, the call goes on, lmdb_end() says so and maps the file's page back.  The handler is
 * installed only while a guarded copy or call runs (the first installs it, the last puts back exactly the
 * disposition it found); a SIGBUS that is not ours goes to that disposition (the program's handler, or the default
 * action).  It never installs itself over a handler installed over it meanwhile (faulthandler.enable() during a copy
 * chains back to it): until that handler is gone, batches are read by preadv and liblmdb's reads are unguarded.
 *
 * The pool's threads are made on first need in each process (a fork handler starts a child's pool afresh), block
 * every asynchronous signal, and read with preadv and copy from the map.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

enum { OK = 0, NEED = 1, WRONG_LENGTH = 2, BAD_HEADER = 3, SHORT = 4, SOURCE = 5, DEST = 6, IO_ERROR = 7 };
enum { TRUSTED, SPENT, COPIED, PREAD, STATE_N }; /* the state array's entries (COPIED: runs from the page cache) */
#define HEAD 16                                 /* an LMDB page header */
#define CALL_PAGES 112                          /* one mincore call costs about as much as checking this many pages */
#define PREFETCH_AHEAD 4
#define STACK_BYTES (256 << 10)
#define SPLIT_BYTES (1 << 20) /* warm bytes from which a batch's short copies are shared by every core */
#define SPLIT_RUN (16 << 10)  /* runs shorter than this on average (random order) are short */

/* ------------------------------------------------------------------------------------------------ SIGBUS */
/* A signal's disposition exactly as the kernel holds it (x86-64, aarch64): saved and put back with the raw system
 * call, so that the program finds every field as it left it.  Elsewhere libc's struct sigaction. */
#if defined(__linux__) && (defined(__x86_64__) || defined(__aarch64__))
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

#define TLS static __thread __attribute__((tls_model("initial-exec")))
TLS sigjmp_buf *volatile current_jump; /* a copy from the map runs on this thread */
TLS void *volatile fault_addr;
#define SPANS 4
TLS int lmdb_depth; /* a guarded liblmdb call runs on this thread, on maps of the file: span[i] = [lo, hi) */
TLS uintptr_t span[SPANS][2];
TLS volatile uintptr_t patched_lo, patched_hi; /* pages replaced by zeros: the first, and past the last */
static disp_t previous;    /* the disposition present when ours was installed (never ours) */
static int guards_running; /* guarded copies and calls in progress, under install_lock */
static int foreign;        /* a handler was installed over ours during a guard: it may chain to ours */
static pthread_mutex_t install_lock = PTHREAD_MUTEX_INITIALIZER;
static long page_bytes = 4096;
static int cpus = 1; /* online, for sharing warm copies */

static void on_sigbus(int sig, siginfo_t *info, void *ctx);
static int get_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t item, int writable, const char *name);

static int is_ours(const disp_t *d) { return disp_siginfo(d) && disp_handler(d) == (void *)on_sigbus; }

static int is_plain(const disp_t *d) { /* SIG_DFL or SIG_IGN: chains to nobody */
    return !disp_siginfo(d) && (disp_handler(d) == (void *)SIG_DFL || disp_handler(d) == (void *)SIG_IGN);
}

/* What would have happened without our handler: the previous handler runs, or the default action. */
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
    uintptr_t a = info != NULL ? (uintptr_t)info->si_addr : 0, page = a & ~(uintptr_t)(page_bytes - 1);
    for (int i = 0; lmdb_depth > 0 && info != NULL && info->si_code == BUS_ADRERR && i < SPANS; i++) {
        if (a < span[i][0] || a >= span[i][1]) continue; /* zeros where the file's page was */
        if ((void *)syscall(SYS_mmap, page, page_bytes, PROT_READ, MAP_PRIVATE | MAP_FIXED | MAP_ANONYMOUS, -1, 0) !=
            (void *)page)
            break;
        if (patched_hi == 0 || page < patched_lo) patched_lo = page;
        if (page + page_bytes > patched_hi) patched_hi = page + page_bytes;
        return;
    }
    chain(sig, info, ctx); /* not one of ours */
}

/* Before a guarded copy or call: 0 with our handler installed (the first installs it), 1 when it must not be (see
 * the top), -1 on error (errno). */
static int enter(void) {
    int rc = 0;
    pthread_mutex_lock(&install_lock);
    if (guards_running == 0) {
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
            rc = 1;
        } else if (sigaction(SIGBUS, &ours, NULL) != 0) {
            rc = -1;
        } else {
            previous = now;
            foreign = 0;
        }
    }
    if (rc == 0) guards_running++;
    pthread_mutex_unlock(&install_lock);
    return rc;
}

/* After a guarded copy or call: the last puts back the handler that was there, unless another was installed over
 * ours. */
static void leave(void) {
    pthread_mutex_lock(&install_lock);
    if (--guards_running == 0) {
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

/* lmdb_begin(spans) -> bool: guard liblmdb's reads of the maps of its data file (spans: int64 pairs, start and end
 * of each map, at most 4) on this thread until lmdb_end() (nested calls share the outer spans); False: not guarded
 * (another SIGBUS handler was installed over ours). */
static PyObject *lmdb_begin(PyObject *self, PyObject *arg) {
    if (lmdb_depth > 0) {
        lmdb_depth++;
        Py_RETURN_TRUE;
    }
    Py_buffer b;
    if (get_buffer(arg, &b, 8, 0, "spans") != 0) return NULL;
    Py_ssize_t n = b.len / 16 < SPANS ? b.len / 16 : SPANS;
    int rc = enter();
    if (rc == 0) {
        memset(span, 0, sizeof span);
        for (Py_ssize_t i = 0; i < n; i++) span[i][0] = ((uint64_t *)b.buf)[2 * i], span[i][1] = ((uint64_t *)b.buf)[2 * i + 1];
        patched_lo = patched_hi = 0, lmdb_depth = 1;
    }
    PyBuffer_Release(&b);
    if (rc < 0) return PyErr_SetFromErrno(PyExc_OSError);
    return PyBool_FromLong(rc == 0);
}

/* lmdb_end(fd) -> bool: end the guard lmdb_begin() started (when it answered True); whether a page was replaced by
 * zeros meanwhile (the file shrank under the call: what it returned is not the file's).  Such pages are mapped from
 * the file `fd` again (the map goes on serving the file, which may have grown back). */
static PyObject *lmdb_end(PyObject *self, PyObject *arg) {
    int fd = PyLong_AsLong(arg);
    if (fd == -1 && PyErr_Occurred()) return NULL;
    if (lmdb_depth == 0 || --lmdb_depth > 0) return PyBool_FromLong(lmdb_depth > 0 && patched_hi != 0);
    uintptr_t lo = patched_lo, hi = patched_hi;
    for (int i = 0; hi != 0 && i < SPANS; i++)
        if (lo >= span[i][0] && hi <= span[i][1])
            mmap((void *)lo, hi - lo, PROT_READ, MAP_SHARED | MAP_FIXED, fd, (off_t)(lo - span[i][0]));
    leave();
    return PyBool_FromLong(hi != 0);
}

/* ------------------------------------------------------------------------------------------------ the batch */
typedef struct {
    int64_t start;  /* file offset of the first byte a read of the run reads */
    int64_t skip;   /* bytes from start to the run's first byte (a head to check and what lies between) */
    int64_t len;    /* the run's bytes, to dst + at */
    int64_t at;
    int64_t before; /* when not cached: bytes read along before start, and after the run (then thrown away) */
    int64_t after;
    int64_t value; /* the value whose head is read (at start); -1: none */
} run_t;

/* One batch's work, shared by the calling thread and the pool's: the warm runs (copied from the map, CHUNK at a
 * time) and the cold ones (read one at a time: each a read in flight). */
typedef struct job {
    const run_t *runs;
    const int64_t *warm, *cold;
    Py_ssize_t nwarm, ncold;
    atomic_long next_warm, next_cold, spent, blocking;
    atomic_int status, faulted;
    atomic_llong detail;
    int fd, probe, page_shift, workers, max_workers, chunk;
    const char *map;
    int64_t size;
    char *dst, *heads, *junk;
    Py_ssize_t dlen;
    unsigned char *pages;
    struct job *link;
} job_t;

#define CHUNK_BYTES (256 << 10) /* warm bytes a thread takes at a time (and copies between looks at its faults) */

static struct {
    pthread_mutex_t mu;
    pthread_cond_t work, idle;
    job_t *jobs;
    int threads;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, 0};
static int nowait_works = 1; /* preadv2(RWF_NOWAIT): a read that only takes what the page cache holds */

/* In a forked child: no thread of the pool came along (nor any other thread's copy or guarded call), and a lock
 * another thread held is held for ever: start afresh, and put back the disposition our handler replaced. */
static void after_fork(void) {
    pthread_mutex_init(&pool.mu, NULL), pthread_cond_init(&pool.work, NULL), pthread_cond_init(&pool.idle, NULL);
    pool.jobs = NULL, pool.threads = 0;
    pthread_mutex_init(&install_lock, NULL);
    disp_t now;
    if (guards_running > 0 && get_disp(&now) == 0 && is_ours(&now)) set_disp(&previous);
    guards_running = 0, lmdb_depth = 0;
}

static void fail(job_t *j, int status, int64_t detail) {
    int none = OK;
    if (atomic_compare_exchange_strong(&j->status, &none, status)) atomic_store(&j->detail, detail);
}

static void mark(job_t *j, int64_t from, int64_t to) { /* the bytes [from, to) are cached now */
    int s = j->page_shift;
    if (j->pages != NULL && to > from) memset(j->pages + (from >> s), 1, (size_t)(((to - 1) >> s) - (from >> s) + 1));
}

/* Read run i: first (where `probe`) only what the page cache holds, then from the disk with what is read along. */
static void read_run(job_t *j, int64_t i, int probe) {
    const run_t *r = &j->runs[i];
    struct iovec iov[5];
    int k = 0, head = r->value >= 0;
    ssize_t got;
    if (probe && nowait_works) {
        if (head) iov[k++] = (struct iovec){j->heads + HEAD * i, HEAD};
        if (r->skip > head * HEAD) iov[k++] = (struct iovec){j->junk, (size_t)(r->skip - head * HEAD)};
        iov[k++] = (struct iovec){j->dst + r->at, (size_t)r->len};
        atomic_fetch_add(&j->spent, CALL_PAGES + ((r->skip + r->len) >> j->page_shift) + 1);
        do got = preadv2(j->fd, iov, k, r->start, RWF_NOWAIT);
        while (got < 0 && errno == EINTR);
        if (got == r->skip + r->len) {
            mark(j, r->start, r->start + got);
            return;
        }
        if (got < 0 && errno == EOPNOTSUPP) nowait_works = 0;
        k = 0;
    }
    atomic_fetch_add(&j->blocking, 1);
    int64_t from = r->start - r->before, want = r->before + r->skip + r->len + r->after;
    if (r->before > 0) iov[k++] = (struct iovec){j->junk, (size_t)r->before};
    if (head) iov[k++] = (struct iovec){j->heads + HEAD * i, HEAD};
    if (r->skip > head * HEAD) iov[k++] = (struct iovec){j->junk, (size_t)(r->skip - head * HEAD)};
    iov[k++] = (struct iovec){j->dst + r->at, (size_t)r->len};
    if (r->after > 0) iov[k++] = (struct iovec){j->junk, (size_t)r->after};
    do got = preadv(j->fd, iov, k, from);
    while (got < 0 && errno == EINTR);
    if (got == want)
        mark(j, from, from + want);
    else if (got >= 0)
        fail(j, SHORT, from + got);
    else
        fail(j, errno == EFAULT ? DEST : IO_ERROR, errno);
}

static long major_faults(void) {
    struct rusage u;
    return getrusage(RUSAGE_THREAD, &u) == 0 ? u.ru_majflt : -1;
}

/* Copy the warm runs a..z-1 from the map (SIGBUS caught: whose page, by the fault's address).  Once a copy took a
 * major fault (a page the page map said was cached was not), the rest are read instead. */
static void copy_warm(job_t *j, Py_ssize_t a, Py_ssize_t z) {
    sigjmp_buf jump;
    if (sigsetjmp(jump, 0) != 0) {
        const char *f = (const char *)fault_addr;
        fail(j, f >= j->dst && f < j->dst + j->dlen && !(f >= j->map && f < j->map + j->size) ? DEST : SOURCE, 0);
        return;
    }
    current_jump = &jump;
    long before = major_faults();
    for (Py_ssize_t x = a; x < z; x++) {
        if (x + PREFETCH_AHEAD < z) {
            const run_t *n = &j->runs[j->warm[x + PREFETCH_AHEAD]];
            __builtin_prefetch(j->map + n->start + n->skip);
            __builtin_prefetch(j->map + n->start + n->skip + n->len - 1);
        }
        int64_t i = j->warm[x];
        const run_t *r = &j->runs[i];
        if (atomic_load_explicit(&j->faulted, memory_order_relaxed)) {
            read_run(j, i, 1);
            continue;
        }
        if (r->value >= 0) memcpy(j->heads + HEAD * i, j->map + r->start, HEAD);
        memcpy(j->dst + r->at, j->map + r->start + r->skip, (size_t)r->len);
    }
    current_jump = NULL;
    if (before >= 0 && major_faults() > before) atomic_store(&j->faulted, 1);
}

/* Take runs of the job until none is left: the cold ones first (each a read in flight), then warm chunks. */
static void work(job_t *j) {
    long i;
    while ((i = atomic_fetch_add(&j->next_cold, 1)) < j->ncold)
        if (atomic_load(&j->status) == OK) read_run(j, j->cold[i], j->probe);
    while ((i = atomic_fetch_add(&j->next_warm, j->chunk)) < j->nwarm)
        if (atomic_load(&j->status) == OK) copy_warm(j, i, i + j->chunk < j->nwarm ? i + j->chunk : j->nwarm);
}

static int has_work(job_t *j) {
    return j->workers < j->max_workers && (atomic_load(&j->next_cold) < j->ncold || atomic_load(&j->next_warm) < j->nwarm);
}

static void *worker(void *unused) {
    pthread_mutex_lock(&pool.mu);
    for (;;) {
        job_t *j = pool.jobs;
        while (j != NULL && !has_work(j)) j = j->link;
        if (j == NULL) {
            pthread_cond_wait(&pool.work, &pool.mu);
            continue;
        }
        j->workers++;
        pthread_mutex_unlock(&pool.mu);
        work(j);
        pthread_mutex_lock(&pool.mu);
        if (--j->workers == 0) pthread_cond_broadcast(&pool.idle);
    }
    return NULL;
}

/* Make the pool hold at least `want` threads (made on first need in each process); under pool.mu.  Returns how
 * many it holds. */
static int grow(int want) {
    if (pool.threads >= want) return pool.threads;
    pthread_attr_t attr;
    sigset_t all, old;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, STACK_BYTES);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    sigfillset(&all); /* the threads inherit this mask: asynchronous signals stay the program's threads' */
    sigdelset(&all, SIGBUS), sigdelset(&all, SIGSEGV), sigdelset(&all, SIGFPE), sigdelset(&all, SIGILL);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    while (pool.threads < want) {
        pthread_t t;
        if (pthread_create(&t, &attr, worker, NULL) != 0) break;
        pool.threads++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    return pool.threads;
}

/* Run the job on this thread and `helpers` of the pool's, and wait for them. */
static void run_job(job_t *j, int helpers) {
    if (helpers > 0) {
        pthread_mutex_lock(&pool.mu);
        int have = grow(helpers);
        j->max_workers = have < helpers ? have : helpers;
        if (j->max_workers > 0) j->link = pool.jobs, pool.jobs = j;
        for (int k = 0; k < j->max_workers; k++) pthread_cond_signal(&pool.work);
        pthread_mutex_unlock(&pool.mu);
    }
    work(j);
    if (j->max_workers > 0) {
        pthread_mutex_lock(&pool.mu);
        while (j->workers > 0) pthread_cond_wait(&pool.idle, &pool.mu);
        job_t **p = &pool.jobs;
        while (*p != j) p = &(*p)->link;
        *p = j->link;
        pthread_mutex_unlock(&pool.mu);
    }
}

/* Whether the page map marks every page of [from, to) cached. */
static int marked(const unsigned char *pages, int shift, int64_t from, int64_t to) {
    for (int64_t p = from >> shift; p <= (to - 1) >> shift; p++)
        if (!pages[p]) return 0;
    return 1;
}

/* A contiguous buffer of `item`-byte items (any format), `writable` or not. */
static int get_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t item, int writable, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) != 0) return -1;
    if (view->itemsize != item) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous array of %zd-byte items", name, item);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

typedef struct {
    int fd, threads;
    const char *map;
    int64_t size, spv, sb, psize, count, vlen, extend;
    unsigned char *pages;
    int64_t *state;
    const int64_t *idx, *offsets;
    unsigned char *checked;
    Py_ssize_t n, nv, npages;
    char *dst;
    Py_ssize_t dlen;
} batch_t;

/* Cut the batch into runs (see the top); NEED/WRONG_LENGTH with the sample or value, else OK. */
static int plan(const batch_t *b, run_t *runs, Py_ssize_t *nruns, int64_t *detail) {
    Py_ssize_t m = 0;
    for (Py_ssize_t i = 0; i < b->n;) {
        int64_t s = b->idx[i], v = s / b->spv;
        if (s < 0 || v >= b->nv) return *detail = i, NEED;
        Py_ssize_t e = i + 1;
        while (e < b->n && b->idx[e] == b->idx[e - 1] + 1 && b->idx[e] / b->spv == v) e++;
        int64_t off = b->offsets[v];
        if (off == -1) return *detail = v, WRONG_LENGTH;
        if (off < 0) return *detail = i, NEED;
        int64_t skip = (s - v * b->spv) * b->sb, rows = e - i;
        int64_t rest = ((b->count - v * b->spv < b->spv ? b->count - v * b->spv : b->spv) - (s - v * b->spv) - rows) * b->sb;
        run_t *r = &runs[m++];
        *r = (run_t){off + skip, 0, rows * b->sb, i * b->sb, 0, 0, -1};
        if (b->psize > 0 && !b->checked[v]) /* read from the header on: it is checked before anything returns */
            r->start = off - HEAD, r->skip = HEAD + skip, r->value = v;
        if (b->extend > 0 && rows >= b->extend) /* block-like: the rest of the value comes along when cold */
            r->before = r->value >= 0 ? 0 : skip, r->after = rest;
        if (r->start - r->before < 0 || r->start + r->skip + r->len + r->after > b->size) return *detail = r->start, SHORT;
        i = e;
    }
    *nruns = m;
    return OK;
}

/* The heads read of the values read for the first time: each names its own page, is an overflow page and has
 * enough pages for its value (else BAD_HEADER with the value); the good ones are marked checked. */
static int check_heads(const batch_t *b, const run_t *runs, Py_ssize_t m, const char *heads, int64_t *detail) {
    for (Py_ssize_t i = 0; i < m; i++) {
        const run_t *r = &runs[i];
        if (r->value < 0) continue;
        const unsigned char *h = (const unsigned char *)heads + HEAD * i;
        uint64_t pgno;
        uint16_t flags;
        uint32_t npages;
        memcpy(&pgno, h, 8), memcpy(&flags, h + 10, 2), memcpy(&npages, h + 12, 4);
        int64_t vlen = r->value == b->nv - 1 ? (b->count - r->value * b->spv) * b->sb + (b->vlen - b->spv * b->sb) : b->vlen;
        int64_t need = (HEAD - 1 + vlen) / b->psize + 1;
        if (pgno != (uint64_t)(r->start / b->psize) || (flags & 0x6F) != 0x04 || (int64_t)npages < need)
            return *detail = r->value, BAD_HEADER;
        b->checked[r->value] = 1;
    }
    return OK;
}

static int run_batch(const batch_t *b, int64_t *detail) {
    size_t n = (size_t)(b->n ? b->n : 1);
    run_t *runs = PyMem_RawMalloc(sizeof(run_t) * n);
    int64_t *order = PyMem_RawMalloc(sizeof(int64_t) * n);
    char *heads = PyMem_RawMalloc((size_t)HEAD * n), *junk = NULL;
    Py_ssize_t m = 0, nwarm = 0, ncold = 0;
    int status = runs && order && heads ? plan(b, runs, &m, detail) : (*detail = ENOMEM, IO_ERROR);
    int guarded = b->map != NULL && status == OK ? enter() : 1;
    const char *map = guarded == 0 ? b->map : NULL; /* no handler of ours: every run is read */
    int shift = __builtin_ctzl((unsigned long)page_bytes), trusted = map != NULL && b->state[TRUSTED];
    int64_t extra = 0, warm_bytes = 0;
    for (Py_ssize_t i = 0; i < m && status == OK; i++) { /* warm: the page map says cached (while trusted) */
        const run_t *r = &runs[i];
        int warm = trusted && marked(b->pages, shift, r->start + r->skip, r->start + r->skip + r->len) &&
                   (r->value < 0 || marked(b->pages, shift, r->start, r->start + HEAD));
        order[warm ? nwarm++ : b->n - 1 - ncold++] = i;
        warm_bytes += warm ? r->len : 0;
        if (r->before + r->skip + r->after > extra) extra = r->before + r->skip + r->after;
    }
    for (Py_ssize_t a = b->n - ncold, z = b->n - 1; a < z; a++, z--) { /* the cold ones in batch order */
        int64_t t = order[a];
        order[a] = order[z], order[z] = t;
    }
    job_t j = {.runs = runs, .warm = order, .cold = order + b->n - ncold, .nwarm = nwarm, .ncold = ncold, .fd = b->fd,
               .probe = map != NULL, .page_shift = shift, .map = map, .size = b->size, .dst = b->dst, .heads = heads,
               .dlen = b->dlen, .pages = map != NULL ? b->pages : NULL};
    atomic_init(&j.next_warm, 0), atomic_init(&j.next_cold, 0), atomic_init(&j.spent, 0), atomic_init(&j.blocking, 0);
    atomic_init(&j.status, OK), atomic_init(&j.faulted, 0), atomic_init(&j.detail, 0);
    if (status == OK && (j.junk = junk = PyMem_RawMalloc((size_t)extra + 1)) == NULL) status = IO_ERROR;
    j.chunk = nwarm > 0 && warm_bytes / nwarm < CHUNK_BYTES ? (int)(CHUNK_BYTES / (warm_bytes / nwarm + 1)) : 1;
    if (status == OK) {
        int helpers = (int)(ncold < b->threads ? ncold : b->threads) - 1;
        if (warm_bytes >= SPLIT_BYTES && warm_bytes / nwarm < SPLIT_RUN && helpers < cpus - 1)
            helpers = cpus - 1; /* short copies, each waiting on memory more than it copies: shared by the cores */
        run_job(&j, helpers);
        status = atomic_load(&j.status), *detail = atomic_load(&j.detail);
    }
    if (guarded == 0) leave();
    if (status == OK && b->psize > 0) status = check_heads(b, runs, m, heads, detail);
    long disk = atomic_load(&j.blocking); /* runs read from the disk; the others came from the page cache */
    b->state[COPIED] += m - disk, b->state[PREAD] += disk, b->state[SPENT] += atomic_load(&j.spent);
    if (atomic_load(&j.faulted)) b->state[TRUSTED] = 0; /* a page the page map said was cached was not */
    if (status == OK && map != NULL && !b->state[TRUSTED] && !disk && b->state[SPENT] >= b->npages &&
        mincore((void *)map, (size_t)b->size, b->pages) == 0) {
        /* wholly cached, and the exact checks since cost a whole-file check: ask once for all, trust the map again */
        for (Py_ssize_t p = 0; p < b->npages; p++) b->pages[p] &= 1;
        b->state[TRUSTED] = 1, b->state[SPENT] = 0;
    }
    PyMem_RawFree(runs), PyMem_RawFree(order), PyMem_RawFree(heads), PyMem_RawFree(junk);
    return status;
}

/* read(fd, map, size, pages, state, dst, idx, offsets, checked, spv, sb, psize, count, vlen, extend, threads)
 *   -> (status, detail): see the top.  map: the address of a read-only map of the file's `size` bytes (0: none);
 * pages: its page map (one byte per page, writable); state: int64[4] (trusted, spent, runs copied, runs read);
 * dst: where sample i of idx goes (sb bytes at i * sb); offsets: each value's payload offset (-1: wrong length,
 * < -1: not known yet: NEED); checked: per value, whether its header was checked (psize 0: no headers);
 * count: samples in all; vlen: a full value's stored bytes (payload and trailer). */
static PyObject *batch_read(PyObject *self, PyObject *args) {
    PyObject *pages_o, *state_o, *dst_o, *idx_o, *offsets_o, *checked_o;
    unsigned long long map;
    batch_t b = {0};
    if (!PyArg_ParseTuple(args, "iKLOOOOOOLLLLLLi:read", &b.fd, &map, &b.size, &pages_o, &state_o, &dst_o, &idx_o,
                          &offsets_o, &checked_o, &b.spv, &b.sb, &b.psize, &b.count, &b.vlen, &b.extend, &b.threads))
        return NULL;
    if (b.spv < 1 || b.sb < 1 || b.psize < 0 || b.threads < 1 || b.size < 0) {
        PyErr_SetString(PyExc_ValueError, "spv, sb and threads must be positive");
        return NULL;
    }
    Py_buffer pages = {0}, state = {0}, dst = {0}, idx = {0}, offsets = {0}, checked = {0};
    PyObject *result = NULL;
    if (get_buffer(pages_o, &pages, 1, 1, "pages") || get_buffer(state_o, &state, 8, 1, "state") ||
        get_buffer(dst_o, &dst, 1, 1, "dst") || get_buffer(idx_o, &idx, 8, 0, "idx") ||
        get_buffer(offsets_o, &offsets, 8, 0, "offsets") || get_buffer(checked_o, &checked, 1, 1, "checked"))
        goto done;
    b.map = (const char *)(uintptr_t)map, b.pages = pages.buf, b.state = state.buf, b.dst = dst.buf, b.dlen = dst.len;
    b.idx = idx.buf, b.offsets = offsets.buf, b.checked = checked.buf;
    b.n = idx.len / 8, b.nv = offsets.len / 8, b.npages = (b.size + page_bytes - 1) / page_bytes;
    if (state.len < 8 * STATE_N || checked.len < b.nv || dst.len < b.n * b.sb || (map && pages.len < b.npages + 1)) {
        PyErr_SetString(PyExc_ValueError, "state, checked, dst or pages is too short");
        goto done;
    }
    int status;
    int64_t detail = 0;
    Py_BEGIN_ALLOW_THREADS
    status = run_batch(&b, &detail);
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("(iL)", status, (long long)detail);
done:
    PyBuffer_Release(&pages), PyBuffer_Release(&state), PyBuffer_Release(&dst);
    PyBuffer_Release(&idx), PyBuffer_Release(&offsets), PyBuffer_Release(&checked);
    return result;
}

static PyMethodDef methods[] = {
    {"read", batch_read, METH_VARARGS, "read(...) -> (status, detail): one batch (see lmdbstore/store/batchread.c)."},
    {"lmdb_begin", lmdb_begin, METH_O, "lmdb_begin(spans) -> bool: guard liblmdb's reads of its maps."},
    {"lmdb_end", lmdb_end, METH_O, "lmdb_end(fd) -> bool: end the guard; whether a page was replaced by zeros."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_batchread", "The compiled read path (see read).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__batchread(void) {
    page_bytes = sysconf(_SC_PAGESIZE), cpus = sysconf(_SC_NPROCESSORS_ONLN) > 1 ? (int)sysconf(_SC_NPROCESSORS_ONLN) : 1;
    if (pthread_atfork(NULL, NULL, after_fork) != 0) return PyErr_NoMemory();
    PyObject *m = PyModule_Create(&module);
    const char *names[] = {"OK", "NEED", "WRONG_LENGTH", "BAD_HEADER", "SHORT", "SOURCE", "DEST", "IO_ERROR"};
    for (int i = 0; m != NULL && i < 8; i++)
        if (PyModule_AddIntConstant(m, names[i], i) != 0) Py_CLEAR(m);
    return m;
}
