/* Generic uprobe handlers for library calls (libtorch, libcudart, libnccl).
 *
 * Appended to bpf/recorder.bpf.c by the loader when library probes are on, so
 * it shares the traced set (bcc rewrites map calls only in the main text).  Every attached probe gets a slot; slot N has its own entry and
 * return handler (api_entry_R_C / api_exit_R_C with N = 16 R + C) so the
 * handler knows which probe fired without a lookup by address.  What a slot
 * decodes is data (the uprobes TOML specs), kept in `api_cfg` by the collector.
 */

struct api_cfg_t {
    s32 deref_arg;      /* argument whose pointee is read (16 bytes), -1 none */
    u32 deref_at_exit;  /* read at return (out-parameters) rather than entry */
    u32 entry_only;     /* emit at entry, do not wait for the return */
    s32 numel_off;      /* tensor_vector: TensorImpl offset of numel, -1 unknown */
    s32 dtype_off;      /* tensor_vector: TensorImpl offset of the dtype index, -1 unknown */
    u32 py_stack;       /* record the calling thread's Python stack */
};

struct api_key_t {
    u32 tid;
    u32 slot;
};

struct api_inflight_t {
    u64 ts;
    u64 args[6];
    u64 deref[2];
    u64 tensor[2];
    u32 flags;
    u32 pad;
};

BPF_ARRAY(api_cfg, struct api_cfg_t, API_SLOTS);
BPF_HASH(api_inflight, struct api_key_t, struct api_inflight_t, 16384);
BPF_RINGBUF_OUTPUT(api_ring, RING_PAGES_API);

/* Processes running a supported CPython: tgid -> address of _PyRuntime.
 * Filled by the collector (uprobes/python_frames.py), which also passes the
 * struct offsets used below as PY_* defines. */
BPF_HASH(py_procs, u32, u64, 4096);
/* tid -> its PyThreadState, checked on every use (a thread state can be
 * freed and its memory reused): the scan below runs once per thread. */
BPF_TABLE("lru_hash", u32, u64, py_tstates, 65536);
BPF_RINGBUF_OUTPUT(pystack_ring, RING_PAGES_PYSTACK);

static __always_inline u64 py_word(u64 addr)
{
    u64 v = 0;
    if (bpf_probe_read_user(&v, sizeof(v), (void *)addr))
        return 0;
    return v;
}

#if PY_FR_PREVIOUS - PY_FR_CODE >= 32 || PY_FR_PREV_INSTR - PY_FR_CODE >= 32
#error "f_code, previous and prev_instr must lie within 32 bytes (uprobes/python_frames.py)"
#endif

/* Copy the calling thread's Python frames (code object, last instruction),
 * innermost first.  The thread state is the one whose native id is this
 * thread's: torch releases the GIL around its calls, so the GIL holder may
 * be another thread, while this one still points at its calling frame. */
static __always_inline void api_py_stack(u32 tgid, u32 tid, u64 ts)
{
    u64 *runtime = py_procs.lookup(&tgid);
    if (!runtime)
        return;
    u64 tstate = 0;
    u64 *known = py_tstates.lookup(&tid);
    if (known && *known && py_word(*known + PY_TS_NATIVE_TID) == tid)
        tstate = *known;
    if (!tstate) {
        u64 interp = py_word(*runtime + PY_RT_INTERP_MAIN);
        if (!interp)
            return;
        u64 t = py_word(interp + PY_IS_THREADS_HEAD);
        for (int i = 0; i < PY_THREAD_SCAN; i++) {
            if (!t)
                break;
            if (py_word(t + PY_TS_NATIVE_TID) == tid) {
                tstate = t;
                break;
            }
            t = py_word(t + PY_TS_NEXT);
        }
        if (!tstate)
            return;
        py_tstates.update(&tid, &tstate);
    }
    u64 cframe = py_word(tstate + PY_TS_CFRAME);
    u64 frame = cframe ? py_word(cframe + PY_CF_CURRENT) : 0;
    if (!frame)
        return;
    struct py_stack_event *e = pystack_ring.ringbuf_reserve(sizeof(struct py_stack_event));
    if (!e) {
        count_drop(RING_PYSTACK);
        return;
    }
    e->ts = ts;
    e->pid = tgid;
    e->tid = tid;
    /* One read per frame: f_code, previous and prev_instr lie in one 32-byte
     * span (a third of the cost of three reads). */
    u32 n = 0;
    for (int i = 0; i < PY_FRAMES; i++) {
        if (!frame)
            break;
        u64 span[4] = {};
        if (bpf_probe_read_user(span, sizeof(span), (void *)(frame + PY_FR_CODE))) {
            frame = 0;
            break;
        }
        e->code[i] = span[0];
        e->instr[i] = span[(PY_FR_PREV_INSTR - PY_FR_CODE) / 8];
        n++;
        frame = span[(PY_FR_PREVIOUS - PY_FR_CODE) / 8];
    }
    e->depth = n;
    e->more = frame != 0;
    pystack_ring.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
}

static __always_inline void api_read_args(struct pt_regs *ctx, u64 *a)
{
    a[0] = PT_REGS_PARM1(ctx);
    a[1] = PT_REGS_PARM2(ctx);
    a[2] = PT_REGS_PARM3(ctx);
    a[3] = PT_REGS_PARM4(ctx);
    a[4] = PT_REGS_PARM5(ctx);
    a[5] = PT_REGS_PARM6(ctx);
}

static __always_inline u32 api_deref(struct api_cfg_t *cfg, u64 *args, u64 *out)
{
    int k = cfg->deref_arg;
    if (k < 0 || k > 5)
        return 0;
    u64 p = args[k & 7];
    if (!p)
        return 0;
    if (bpf_probe_read_user(out, 16, (void *)p) == 0)
        return 1;
    /* near the end of a mapping: an int out-parameter still fits */
    return bpf_probe_read_user(out, 4, (void *)p) == 0;
}

/* deref[0] is the begin of a std::vector<at::Tensor>; an at::Tensor is one
 * intrusive pointer to its TensorImpl, where numel and the dtype index live
 * at offsets measured for this libtorch (uprobes/tensor_layout.py). */
static __always_inline u32 api_tensor(struct api_cfg_t *cfg, u64 *deref, u64 *out)
{
    if (cfg->numel_off < 0 || cfg->dtype_off < 0 || deref[1] <= deref[0])
        return 0;
    u64 impl = 0;
    if (bpf_probe_read_user(&impl, sizeof(impl), (void *)deref[0]) || !impl)
        return 0;
    u16 dtype = 0;
    if (bpf_probe_read_user(&out[0], sizeof(u64), (void *)(impl + (cfg->numel_off & 0xfff))) ||
        bpf_probe_read_user(&dtype, sizeof(dtype), (void *)(impl + (cfg->dtype_off & 0xfff))))
        return 0;
    out[1] = dtype;
    return 2;
}

static __always_inline void api_emit(u32 tgid, u32 tid, u32 slot, u64 ts, u64 dur, s64 ret,
                                     u64 *args, u64 *deref, u64 *tensor, u32 flags)
{
    struct api_event *e = api_ring.ringbuf_reserve(sizeof(struct api_event));
    if (!e) {
        count_drop(RING_API);
        return;
    }
    e->ts = ts;
    e->dur = dur;
    e->pid = tgid;
    e->tid = tid;
    e->slot = slot;
    e->flags = flags;
    e->ret = ret;
    #pragma unroll
    for (int i = 0; i < 6; i++)
        e->args[i] = args[i];
    e->deref[0] = deref[0];
    e->deref[1] = deref[1];
    e->tensor[0] = tensor[0];
    e->tensor[1] = tensor[1];
    api_ring.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
}

static __always_inline int api_on_entry(struct pt_regs *ctx, u32 slot)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    if (!is_traced(tgid))
        return 0;
    struct api_cfg_t *cfg = api_cfg.lookup(&slot);
    if (!cfg)
        return 0;
    struct api_inflight_t v = {};
    v.ts = bpf_ktime_get_ns();
    api_read_args(ctx, v.args);
    if (cfg->py_stack)
        api_py_stack(tgid, tid, v.ts);
    if (!cfg->deref_at_exit) {
        v.flags = api_deref(cfg, v.args, v.deref);
        if (v.flags)
            v.flags |= api_tensor(cfg, v.deref, v.tensor);
    }
    if (cfg->entry_only) {
        api_emit(tgid, tid, slot, v.ts, 0, 0, v.args, v.deref, v.tensor, v.flags);
        return 0;
    }
    struct api_key_t key = {.tid = tid, .slot = slot};
    api_inflight.update(&key, &v);
    return 0;
}

static __always_inline int api_on_exit(struct pt_regs *ctx, u32 slot)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    struct api_key_t key = {.tid = tid, .slot = slot};
    struct api_inflight_t *v = api_inflight.lookup(&key);
    if (!v)
        return 0;
    struct api_cfg_t *cfg = api_cfg.lookup(&slot);
    if (cfg && cfg->deref_at_exit)
        v->flags = api_deref(cfg, v->args, v->deref);
    api_emit(tgid, tid, slot, v->ts, bpf_ktime_get_ns() - v->ts, PT_REGS_RC(ctx), v->args, v->deref,
             v->tensor, v->flags);
    api_inflight.delete(&key);
    return 0;
}

/* ld.so calls _dl_debug_state after every change to its link map (how
 * debuggers follow dlopen).  Telling the collector at once lets it attach the
 * spec'd probes to a freshly loaded library before the code in it runs much. */
int dl_debug_state(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    if (!is_traced(tgid))
        return 0;
    emit_proc(PROC_DLOPEN, tgid, tid, 0, 0, 0, 0);
    return 0;
}

#define API_PAIR(r, c)                                                             \
    int api_entry_##r##_##c(struct pt_regs *ctx) { return api_on_entry(ctx, r * 16 + c); } \
    int api_exit_##r##_##c(struct pt_regs *ctx) { return api_on_exit(ctx, r * 16 + c); }

#define API_ROW(r)                                                                  \
    API_PAIR(r, 0) API_PAIR(r, 1) API_PAIR(r, 2) API_PAIR(r, 3) API_PAIR(r, 4)       \
    API_PAIR(r, 5) API_PAIR(r, 6) API_PAIR(r, 7) API_PAIR(r, 8) API_PAIR(r, 9)       \
    API_PAIR(r, 10) API_PAIR(r, 11) API_PAIR(r, 12) API_PAIR(r, 13) API_PAIR(r, 14)  \
    API_PAIR(r, 15)

/* API_SLOTS = 16 * API_ROWS, set by the loader to what the probe set needs. */
API_ROW(0)
#if API_ROWS > 1
API_ROW(1)
#endif
#if API_ROWS > 2
API_ROW(2)
#endif
#if API_ROWS > 3
API_ROW(3)
#endif
#if API_ROWS > 4
API_ROW(4)
#endif
#if API_ROWS > 5
API_ROW(5)
#endif
#if API_ROWS > 6
API_ROW(6)
#endif
#if API_ROWS > 7
API_ROW(7)
#endif
#if API_ROWS > 8
API_ROW(8)
#endif
#if API_ROWS > 9
API_ROW(9)
#endif
#if API_ROWS > 10
API_ROW(10)
#endif
#if API_ROWS > 11
API_ROW(11)
#endif
#if API_ROWS > 12
API_ROW(12)
#endif
#if API_ROWS > 13
API_ROW(13)
#endif
#if API_ROWS > 14
API_ROW(14)
#endif
#if API_ROWS > 15
API_ROW(15)
#endif
