/* A stand-in for libascendcl.so: the few ACL calls the core's StreamNotifier makes, with counters.
 * Built by tests/test_device_drivers.py; no Ascend runtime is involved. */
#include <pthread.h>
#include <stdint.h>
#include <time.h>

typedef void (*callback_t)(void *);
#define CTX ((void *)0x1234)
#define QMAX 4096
#define SMAX 256

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cond = PTHREAD_COND_INITIALIZER;
static callback_t fns[QMAX];
static void *args[QMAX];
static int head, tail;
static __thread void *current;
static uint64_t sub_stream[SMAX], sub_thread[SMAX];
static int nsub;
static uint64_t report_threads[64];
static int nreport;

int fake_subscribes, fake_unsubscribes, fake_process_calls, fake_launches, fake_without_context, fake_report_threads;

int aclrtGetCurrentContext(void **ctx) { *ctx = CTX; return 0; }
int aclrtSetCurrentContext(void *ctx) { current = ctx; return 0; }
const char *aclGetRecentErrMsg(void) { return "fake"; }
int fake_subscribed(void) { int n; pthread_mutex_lock(&lock); n = nsub; pthread_mutex_unlock(&lock); return n; }

int aclrtSubscribeReport(uint64_t thread, void *stream) {
    int i, rc = 0;
    pthread_mutex_lock(&lock);
    if (current != CTX) fake_without_context++;
    for (i = 0; i < nsub; i++)
        if (sub_stream[i] == (uint64_t)stream) rc = 107000;  /* already subscribed (to any thread) */
    if (!rc && nsub < SMAX) {
        sub_stream[nsub] = (uint64_t)stream; sub_thread[nsub] = thread; nsub++; fake_subscribes++;
        for (i = 0; i < nreport && report_threads[i] != thread; i++) {}
        if (i == nreport && nreport < 64) report_threads[nreport++] = thread;
        fake_report_threads = nreport;
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

int aclrtUnSubscribeReport(uint64_t thread, void *stream) {
    int i, rc = 107001;
    pthread_mutex_lock(&lock);
    for (i = 0; i < nsub; i++)
        if (sub_stream[i] == (uint64_t)stream && sub_thread[i] == thread) {
            sub_stream[i] = sub_stream[nsub - 1]; sub_thread[i] = sub_thread[nsub - 1]; nsub--;
            fake_unsubscribes++; rc = 0; break;
        }
    pthread_mutex_unlock(&lock);
    return rc;
}

int aclrtLaunchCallback(callback_t fn, void *arg, int block, void *stream) {
    int i, known = 0;
    pthread_mutex_lock(&lock);
    if (current != CTX) fake_without_context++;
    for (i = 0; i < nsub; i++) if (sub_stream[i] == (uint64_t)stream) known = 1;
    if (!known) { pthread_mutex_unlock(&lock); return 107002; }
    fns[tail % QMAX] = fn; args[tail % QMAX] = arg; tail++; fake_launches++;
    pthread_cond_broadcast(&cond);
    pthread_mutex_unlock(&lock);
    return 0;
}

int aclrtProcessReport(int32_t timeout_ms) {
    struct timespec t;
    int ran = 0;
    pthread_mutex_lock(&lock);
    fake_process_calls++;
    if (nsub == 0) { pthread_mutex_unlock(&lock); return 107003; }  /* nothing subscribed: fails at once */
    clock_gettime(CLOCK_REALTIME, &t);
    t.tv_nsec += (long)timeout_ms * 1000000L;
    t.tv_sec += t.tv_nsec / 1000000000L; t.tv_nsec %= 1000000000L;
    while (head == tail)
        if (pthread_cond_timedwait(&cond, &lock, &t)) break;
    while (head != tail) {
        callback_t fn = fns[head % QMAX]; void *arg = args[head % QMAX]; head++;
        pthread_mutex_unlock(&lock); fn(arg); ran++; pthread_mutex_lock(&lock);
    }
    pthread_mutex_unlock(&lock);
    return ran ? 0 : 507000;  /* time-out */
}
