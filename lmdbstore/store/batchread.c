/* lmdbstore.store.batchread: the compiled read path of lmdbstore (store/fileread.py drives it; docs/design.md,
 * "Reads by file offset" and "No SIGBUS", says what it does and why).
 *
 * read() does one whole batch with the GIL released: it cuts the batch into runs, copies the cached ones from the
 * read-only map of the data file and reads the others with preadv on a pool of threads of its own (made on first
 * need in each process, every asynchronous signal blocked), checking the overflow header of each value read for
 * the first time.  Which pages are cached, a page map says (trusted until a copy takes a major fault; then runs are
 * probed by preadv2(RWF_NOWAIT) until one mincore() over the file is worth it): only speed depends on it.
 *
 * SIGBUS: copies from the map and liblmdb's reads of its map (lmdb_begin/lmdb_end) are guarded by one handler,
 * installed only while a guarded copy or call runs; it puts back exactly the disposition it found, sends a SIGBUS
 * not ours there, and never installs itself over a handler installed over it meanwhile.  Linux on x86-64 or
 * aarch64 only (the kernel's struct sigaction below); elsewhere the build fails and lmdbstore reads by os.preadv.
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
/* A signal's disposition exactly as the kernel holds it: saved and put back with the raw system call, so that the
 * program finds every field as it left it. */
#if !defined(__linux__) || !(defined(__x86_64__) || defined(__aarch64__))
#error "the kernel's struct sigaction of x86-64 and aarch64 only"
#endif
typedef struct {
    void *handler;
    unsigned long flags;
    void *restorer;
    uint64_t mask;
} disp_t;
static int get_disp(disp_t *d) { return (int)syscall(SYS_rt_sigaction, SIGBUS, NULL, d, sizeof d->mask); }
static int set_disp(const disp_t *d) { return (int)syscall(SYS_rt_sigaction, SIGBUS, d, NULL, sizeof d->mask); }

#define TLS static __thread __attribute__((tls_model("initial-exec")))
TLS sigjmp_buf *volatile current_jump; /* a copy from the map runs on this thread */
TLS void *volatile fault_addr;
#define SPANS 4
TLS int lmdb_depth; /* a guarded liblmdb call runs on this thread, on maps of the file: span[i] = [lo, hi) */
TLS uintptr_t span[SPANS][2];
TLS volatile uintptr_t patched_lo, patched_hi; /* pages replaced by zeros: the first, and past the last */
TLS long patches_before;                         /* `patches` when this thread's guard began */
static atomic_long patches; /* pages replaced by zeros in the process: another thread's call may have read them */
static disp_t previous;    /* the disposition present when ours was installed (never ours) */
static int guards_running; /* guarded copies and calls in progress, under install_lock */
static int foreign;        /* a handler was installed over ours during a guard: it may chain to ours */
static pthread_mutex_t install_lock = PTHREAD_MUTEX_INITIALIZER;
static long page_bytes = 4096;
static int cpus = 1; /* online, for sharing warm copies */

/* What would have happened without our handler: the previous handler runs, or the default action. */
static void chain(int sig, siginfo_t *info, void *ctx) {
    void *h = previous.handler;
    int sent = info != NULL && info->si_code <= 0; /* kill(), sigqueue(), tgkill(): not a fault */
    if (previous.flags & SA_SIGINFO) {
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
        atomic_fetch_add(&patches, 1);
        if (patched_hi == 0 || page < patched_lo) patched_lo = page;
        if (page + page_bytes > patched_hi) patched_hi = page + page_bytes;
        return;
    }
    chain(sig, info, ctx); /* not one of ours */
}

static int is_ours(const disp_t *d) { return (d->flags & SA_SIGINFO) && d->handler == (void *)on_sigbus; }

static int is_plain(const disp_t *d) { /* SIG_DFL or SIG_IGN: chains to nobody */
    return !(d->flags & SA_SIGINFO) && (d->handler == (void *)SIG_DFL || d->handler == (void *)SIG_IGN);
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

/* After a guarded copy or call: the last puts back the handler that was there, unless another was put over ours. */
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
        patched_lo = patched_hi = 0, lmdb_depth = 1, patches_before = atomic_load(&patches);
    }
    PyBuffer_Release(&b);
    if (rc < 0) return PyErr_SetFromErrno(PyExc_OSError);
    return PyBool_FromLong(rc == 0);
}

/* lmdb_end(fd) -> bool: end the guard lmdb_begin() started (when it answered True); whether a page was replaced by
 * zeros meanwhile, by this call or another thread's (what it returned may not be the file's).  This call's such pages
 * are mapped from the file `fd` again (the map goes on serving the file, which may have grown back). */
static PyObject *lmdb_end(PyObject *self, PyObject *arg) {
    int fd = PyLong_AsLong(arg);
    if (fd == -1 && PyErr_Occurred()) return NULL;
    if (lmdb_depth == 0 || --lmdb_depth > 0) return PyBool_FromLong(lmdb_depth > 0 && patched_hi != 0);
    uintptr_t lo = patched_lo, hi = patched_hi;
    for (int i = 0; hi != 0 && i < SPANS; i++)
        if (lo >= span[i][0] && hi <= span[i][1])
            mmap((void *)lo, hi - lo, PROT_READ, MAP_SHARED | MAP_FIXED, fd, (off_t)(lo - span[i][0]));
    leave();
    return PyBool_FromLong(hi != 0 || atomic_load(&patches) != patches_before);
}

/* ------------------------------------------------------------------------------------------------ the batch */
/* One store's part of a call: its file, map, page map and state, its table, its indices and destination. */
typedef struct {
    int fd, rfd;     /* rfd: the same file without read-ahead, for runs read with their whole value */
    const char *map; /* NULL: every run is read */
    int64_t size, spv, sb, psize, count, vlen, extend, npages;
    unsigned char *pages, *checked;
    int64_t *state;
    const int64_t *idx, *offsets;
    Py_ssize_t n, nv, first, nruns; /* its runs: first .. first + nruns - 1 */
    char *dst;
    Py_ssize_t dlen;
    int64_t detail;
    atomic_int status, faulted;
    atomic_llong spent, blocking;
} batch_t;

typedef struct {
    int64_t start;  /* file offset of the first byte a read of the run reads */
    int64_t skip;   /* bytes from start to the run's first byte (a head to check and what lies between) */
    int64_t len;    /* the run's bytes, to dst + at */
    int64_t at;
    int64_t before; /* when not cached: bytes read along before start, and after the run (then thrown away) */
    int64_t after;
    int64_t value; /* the value whose head is read (at start); -1: none */
    batch_t *b;
    int bulk; /* a piece of `extend` samples or more: read through rfd */
} run_t;

/* One call's work, shared by the calling thread and the pool's: the warm runs (copied from the map, `chunk` at a
 * time) and the cold ones (read one at a time: each a read in flight). */
typedef struct job {
    const run_t *runs;
    const int64_t *warm, *cold;
    Py_ssize_t nwarm, ncold;
    atomic_long next_warm, next_cold;
    int page_shift, workers, max_workers, chunk;
    char *heads, *junk;
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

static void fail(batch_t *b, int status, int64_t detail) {
    int none = OK;
    if (atomic_compare_exchange_strong(&b->status, &none, status)) b->detail = detail;
}

static void mark(const batch_t *b, int s, int64_t from, int64_t to) { /* the bytes [from, to) are cached now */
    if (b->map != NULL && to > from) memset(b->pages + (from >> s), 1, (size_t)(((to - 1) >> s) - (from >> s) + 1));
}

/* Read run i: first (where the map may be read) only what the page cache holds, then from the disk. */
static void read_run(job_t *j, int64_t i) {
    const run_t *r = &j->runs[i];
    batch_t *b = r->b;
    struct iovec iov[5];
    int k = 0, head = r->value >= 0, s = j->page_shift;
    ssize_t got;
    if (b->map != NULL && nowait_works) {
        if (head) iov[k++] = (struct iovec){j->heads + HEAD * i, HEAD};
        if (r->skip > head * HEAD) iov[k++] = (struct iovec){j->junk, (size_t)(r->skip - head * HEAD)};
        iov[k++] = (struct iovec){b->dst + r->at, (size_t)r->len};
        atomic_fetch_add(&b->spent, CALL_PAGES + ((r->skip + r->len) >> s) + 1);
        do got = preadv2(b->fd, iov, k, r->start, RWF_NOWAIT);
        while (got < 0 && errno == EINTR);
        if (got == r->skip + r->len) {
            mark(b, s, r->start, r->start + got);
            return;
        }
        if (got < 0 && errno == EOPNOTSUPP) nowait_works = 0;
        k = 0;
    }
    atomic_fetch_add(&b->blocking, 1);
    int64_t from = r->start - r->before, want = r->before + r->skip + r->len + r->after;
    if (r->before > 0) iov[k++] = (struct iovec){j->junk, (size_t)r->before};
    if (head) iov[k++] = (struct iovec){j->heads + HEAD * i, HEAD};
    if (r->skip > head * HEAD) iov[k++] = (struct iovec){j->junk, (size_t)(r->skip - head * HEAD)};
    iov[k++] = (struct iovec){b->dst + r->at, (size_t)r->len};
    if (r->after > 0) iov[k++] = (struct iovec){j->junk, (size_t)r->after};
    do got = preadv(r->bulk ? b->rfd : b->fd, iov, k, from);
    while (got < 0 && errno == EINTR);
    if (got == want)
        mark(b, s, from, from + want);
    else if (got >= 0)
        fail(b, SHORT, from + got);
    else
        fail(b, errno == EFAULT ? DEST : IO_ERROR, errno);
}

static long major_faults(void) {
    struct rusage u;
    return getrusage(RUSAGE_THREAD, &u) == 0 ? u.ru_majflt : -1;
}

/* Copy the warm runs a..z-1 from their maps (SIGBUS caught: whose page, by the fault's address).  Once a copy took a
 * major fault (a page the page map said was cached was not), the rest of that store's runs are read instead. */
static void copy_warm(job_t *j, const Py_ssize_t a, const Py_ssize_t z) {
    sigjmp_buf jump;
    volatile Py_ssize_t x = a, first = a;
    if (sigsetjmp(jump, 0) != 0) {
        batch_t *b = j->runs[j->warm[x]].b;
        const char *f = (const char *)fault_addr;
        fail(b, f >= b->dst && f < b->dst + b->dlen && !(f >= b->map && f < b->map + b->size) ? DEST : SOURCE, 0);
        return;
    }
    current_jump = &jump;
    long before = major_faults();
    for (; x < z; x++) {
        if (x + PREFETCH_AHEAD < z) {
            const run_t *n = &j->runs[j->warm[x + PREFETCH_AHEAD]];
            __builtin_prefetch(n->b->map + n->start + n->skip);
            __builtin_prefetch(n->b->map + n->start + n->skip + n->len - 1);
        }
        int64_t i = j->warm[x];
        const run_t *r = &j->runs[i];
        if (atomic_load_explicit(&r->b->faulted, memory_order_relaxed)) {
            read_run(j, i);
            continue;
        }
        if (r->value >= 0) memcpy(j->heads + HEAD * i, r->b->map + r->start, HEAD);
        memcpy(r->b->dst + r->at, r->b->map + r->start + r->skip, (size_t)r->len);
    }
    current_jump = NULL;
    if (before >= 0 && major_faults() > before) /* whose page it was, this thread cannot tell: all of its stores' */
        for (Py_ssize_t y = first; y < z; y++) atomic_store(&j->runs[j->warm[y]].b->faulted, 1);
}

/* Take runs of the job until none is left: the cold ones first (each a read in flight), then warm chunks. */
static void work(job_t *j) {
    long i;
    while ((i = atomic_fetch_add(&j->next_cold, 1)) < j->ncold) {
        batch_t *b = j->runs[j->cold[i]].b;
        if (atomic_load(&b->status) == OK) read_run(j, j->cold[i]);
    }
    while ((i = atomic_fetch_add(&j->next_warm, j->chunk)) < j->nwarm) copy_warm(j, i, i + j->chunk < j->nwarm ? i + j->chunk : j->nwarm);
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

/* Make the pool hold at least `want` threads (on first need in each process), under pool.mu: how many it holds. */
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

/* Cut the store's batch into runs from runs[b->first] on (see the top); NEED/WRONG_LENGTH/SHORT with the sample,
 * value or offset, else OK. */
static int plan(batch_t *b, run_t *runs) {
    Py_ssize_t m = b->first;
    for (Py_ssize_t i = 0; i < b->n;) {
        int64_t s = b->idx[i], v = s / b->spv;
        if (s < 0 || v >= b->nv) return b->detail = i, NEED;
        Py_ssize_t e = i + 1;
        while (e < b->n && b->idx[e] == b->idx[e - 1] + 1 && b->idx[e] / b->spv == v) e++;
        int64_t off = b->offsets[v];
        if (off == -1) return b->detail = v, WRONG_LENGTH;
        if (off < 0) return b->detail = i, NEED;
        int64_t skip = (s - v * b->spv) * b->sb, rows = e - i;
        int64_t rest = ((b->count - v * b->spv < b->spv ? b->count - v * b->spv : b->spv) - (s - v * b->spv) - rows) * b->sb;
        run_t *r = &runs[m++];
        *r = (run_t){off + skip, 0, rows * b->sb, i * b->sb, 0, 0, -1, b, b->extend > 0 && rows >= b->extend};
        if (b->psize > 0 && !b->checked[v]) /* read from the header on: it is checked before anything returns */
            r->start = off - HEAD, r->skip = HEAD + skip, r->value = v;
        if (r->bulk) /* block-like: the rest of the value comes along when cold */
            r->before = r->value >= 0 ? 0 : skip, r->after = rest;
        if (r->start - r->before < 0 || r->start + r->skip + r->len + r->after > b->size) return b->detail = r->start, SHORT;
        i = e;
    }
    b->nruns = m - b->first;
    return OK;
}

/* The heads read of the values read for the first time: each names its own page, is an overflow page and has
 * enough pages for its value (else BAD_HEADER with the value); the good ones are marked checked. */
static int check_heads(batch_t *b, const run_t *runs, const char *heads) {
    for (Py_ssize_t i = b->first; i < b->first + b->nruns; i++) {
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
            return b->detail = r->value, BAD_HEADER;
        b->checked[r->value] = 1;
    }
    return OK;
}

/* Read the batches bs[0..nb-1] as one job (see the top); each gets its own status. */
static void run_batches(batch_t *bs, Py_ssize_t nb, int threads) {
    Py_ssize_t n = 1, m = 0, nwarm = 0, ncold = 0;
    for (Py_ssize_t k = 0; k < nb; k++) n += bs[k].n;
    run_t *runs = PyMem_RawMalloc(sizeof(run_t) * (size_t)n);
    int64_t *order = PyMem_RawMalloc(2 * sizeof(int64_t) * (size_t)n); /* the warm runs, then from n on the cold */
    char *heads = PyMem_RawMalloc((size_t)HEAD * (size_t)n), *junk = NULL;
    int guarded = 1, shift = __builtin_ctzl((unsigned long)page_bytes);
    int64_t extra = 0, warm_bytes = 0;
    for (Py_ssize_t k = 0; k < nb; k++) {
        batch_t *b = &bs[k];
        b->first = m;
        int st = runs && order && heads ? plan(b, runs) : (b->detail = ENOMEM, IO_ERROR);
        atomic_store(&b->status, st);
        if (st != OK) continue;
        if (b->map != NULL && guarded == 1) guarded = enter();
        if (guarded != 0) b->map = NULL; /* no handler of ours: every run is read */
        for (Py_ssize_t i = m; i < m + b->nruns; i++) { /* warm: the page map says cached (while trusted) */
            const run_t *r = &runs[i];
            int warm = b->map != NULL && b->state[TRUSTED] &&
                       marked(b->pages, shift, r->start + r->skip, r->start + r->skip + r->len) &&
                       (r->value < 0 || marked(b->pages, shift, r->start, r->start + HEAD));
            order[warm ? nwarm++ : n + ncold++] = i;
            warm_bytes += warm ? r->len : 0;
            if (r->before + r->skip + r->after > extra) extra = r->before + r->skip + r->after;
        }
        m += b->nruns;
    }
    job_t j = {.runs = runs, .warm = order, .cold = order + n, .nwarm = nwarm, .ncold = ncold,
               .page_shift = shift, .heads = heads};
    atomic_init(&j.next_warm, 0), atomic_init(&j.next_cold, 0);
    j.chunk = nwarm > 0 && warm_bytes / nwarm < CHUNK_BYTES ? (int)(CHUNK_BYTES / (warm_bytes / nwarm + 1)) : 1;
    if (m > 0 && (j.junk = junk = PyMem_RawMalloc((size_t)extra + 1)) != NULL) {
        int helpers = (int)(ncold < threads ? ncold : threads) - 1;
        if (warm_bytes >= SPLIT_BYTES && warm_bytes / nwarm < SPLIT_RUN && helpers < cpus - 1)
            helpers = cpus - 1; /* short copies, each waiting on memory more than it copies: shared by the cores */
        run_job(&j, helpers);
    }
    if (guarded == 0) leave();
    for (Py_ssize_t k = 0; k < nb; k++) {
        batch_t *b = &bs[k];
        if (m > 0 && junk == NULL) fail(b, IO_ERROR, ENOMEM);
        if (atomic_load(&b->status) == OK && b->psize > 0) atomic_store(&b->status, check_heads(b, runs, heads));
        long disk = atomic_load(&b->blocking); /* runs read from the disk; the others came from the page cache */
        b->state[COPIED] += b->nruns - disk, b->state[PREAD] += disk, b->state[SPENT] += atomic_load(&b->spent);
        if (atomic_load(&b->faulted)) b->state[TRUSTED] = 0; /* a page the page map said was cached was not */
        if (atomic_load(&b->status) == OK && b->map != NULL && !b->state[TRUSTED] && !disk &&
            b->state[SPENT] >= b->npages && mincore((void *)b->map, (size_t)b->size, b->pages) == 0) {
            /* wholly cached, and the probes since cost a whole-file check: ask once for all, trust the map again */
            for (Py_ssize_t p = 0; p < b->npages; p++) b->pages[p] &= 1;
            b->state[TRUSTED] = 1, b->state[SPENT] = 0;
        }
    }
    PyMem_RawFree(runs), PyMem_RawFree(order), PyMem_RawFree(heads), PyMem_RawFree(junk);
}

#define BUFFERS 6
/* One store's part from its tuple (see read); its buffers in views[0..BUFFERS-1]; -1 with an exception. */
static int parse_batch(PyObject *spec, batch_t *b, Py_buffer *views) {
    PyObject *o[BUFFERS];
    unsigned long long map;
    if (!PyArg_ParseTuple(spec, "iiKLOOOOOOLLLLLL:read", &b->fd, &b->rfd, &map, &b->size, &o[0], &o[1], &o[2], &o[3], &o[4],
                          &o[5], &b->spv, &b->sb, &b->psize, &b->count, &b->vlen, &b->extend))
        return -1;
    if (b->spv < 1 || b->sb < 1 || b->psize < 0 || b->size < 0) {
        PyErr_SetString(PyExc_ValueError, "spv and sb must be positive");
        return -1;
    }
    const char *names[BUFFERS] = {"pages", "state", "dst", "idx", "offsets", "checked"};
    const Py_ssize_t items[BUFFERS] = {1, 8, 1, 8, 8, 1};
    const int writable[BUFFERS] = {1, 1, 1, 0, 0, 1};
    for (int k = 0; k < BUFFERS; k++)
        if (get_buffer(o[k], &views[k], items[k], writable[k], names[k]) != 0) return -1;
    b->map = (const char *)(uintptr_t)map, b->pages = views[0].buf, b->state = views[1].buf, b->dst = views[2].buf;
    b->dlen = views[2].len, b->idx = views[3].buf, b->offsets = views[4].buf, b->checked = views[5].buf;
    b->n = views[3].len / 8, b->nv = views[4].len / 8, b->npages = (b->size + page_bytes - 1) / page_bytes;
    if (views[1].len < 8 * STATE_N || views[5].len < b->nv || b->dlen < b->n * b->sb ||
        (map && views[0].len < b->npages + 1)) {
        PyErr_SetString(PyExc_ValueError, "state, checked, dst or pages is too short");
        return -1;
    }
    return 0;
}

/* read(threads, batches) -> [(status, detail)]: each batch (a store's part) is a tuple (fd, rfd, map, size, pages,
 * state, dst, idx, offsets, checked, spv, sb, psize, count, vlen, extend), all read in one job (see the top).
 * map: the address of a read-only map of the file's `size` bytes (0: none); pages: its page map (one byte per page);
 * state: int64[4] (trusted, probes spent, runs the page cache held, runs read from the disk); dst: where sample i of
 * idx goes (sb bytes at i * sb); offsets: each value's payload offset (-1: wrong length, < -1: not located: NEED);
 * checked: per value, whether its header was checked (psize 0: no headers); count: samples in all; vlen: a full
 * value's stored bytes (payload and trailer); extend: runs this long read their whole value when cold. */
static PyObject *batch_read(PyObject *self, PyObject *args) {
    int threads;
    PyObject *specs, *result = NULL;
    if (!PyArg_ParseTuple(args, "iO!:read", &threads, &PyList_Type, &specs)) return NULL;
    Py_ssize_t nb = PyList_GET_SIZE(specs);
    batch_t *bs = PyMem_Calloc((size_t)nb + 1, sizeof(batch_t));
    Py_buffer *views = PyMem_Calloc((size_t)(nb + 1) * BUFFERS, sizeof(Py_buffer));
    Py_ssize_t parsed = 0;
    if (bs == NULL || views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; parsed < nb; parsed++)
        if (parse_batch(PyList_GET_ITEM(specs, parsed), &bs[parsed], views + BUFFERS * parsed) != 0) goto done;
    Py_BEGIN_ALLOW_THREADS
    run_batches(bs, nb, threads > 0 ? threads : 1);
    Py_END_ALLOW_THREADS
    result = PyList_New(nb);
    for (Py_ssize_t k = 0; result != NULL && k < nb; k++)
        PyList_SET_ITEM(result, k, Py_BuildValue("(iL)", atomic_load(&bs[k].status), (long long)bs[k].detail));
done:
    for (Py_ssize_t k = 0; views != NULL && k < (parsed + 1) * BUFFERS; k++)
        if (views[k].obj != NULL) PyBuffer_Release(&views[k]);
    PyMem_Free(bs), PyMem_Free(views);
    return result;
}

static PyMethodDef methods[] = {
    {"read", batch_read, METH_VARARGS, "read(threads, batches) -> [(status, detail)]: see lmdbstore/store/batchread.c."},
    {"lmdb_begin", lmdb_begin, METH_O, "lmdb_begin(spans) -> bool: guard liblmdb's reads of its maps."},
    {"lmdb_end", lmdb_end, METH_O, "lmdb_end(fd) -> bool: end the guard; whether a page was replaced by zeros."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "batchread", "The compiled read path (see read).", -1,
                                    methods};

PyMODINIT_FUNC PyInit_batchread(void) {
    page_bytes = sysconf(_SC_PAGESIZE), cpus = sysconf(_SC_NPROCESSORS_ONLN) > 1 ? (int)sysconf(_SC_NPROCESSORS_ONLN) : 1;
    if (pthread_atfork(NULL, NULL, after_fork) != 0) return PyErr_NoMemory();
    return PyModule_Create(&module);
}
