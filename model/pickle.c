/* pickle: restricted unpickler for torch.save state dicts (see pickle.h).
 *
 * A pickle is a little stack machine: opcodes push values, MARK remembers a
 * stack height so that TUPLE/APPENDS/SETITEMS can take "everything since the
 * mark", the memo lets a value be referenced again (tied weights, repeated
 * storage types), and STOP returns the top of the stack. As in CPython's
 * unpickler, a MARK starts a fresh region: no opcode may pop below the most
 * recent mark. The handful of "calls" a state dict needs are interpreted
 * here, by name, instead of being looked up and run. */
#include "model/pickle.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const uint8_t *p;
    size_t len, pos;
    size_t op_at; /* offset of the opcode being executed, for messages */
    uint8_t op;
    pk_arena *arena;
    pk_value **stack;
    size_t sp, stack_cap;
    size_t marks[PK_MAX_MARKS];
    size_t n_marks;
    pk_value **memo; /* index -> value (NULL: unset) */
    size_t memo_cap, memo_set;
    pd_err *err;
} unpickler;

static const struct {
    const char *module, *name, *qualname;
    pk_global which;
    ckpt_dtype dtype;
} allowed_globals[] = {
    {"collections", "OrderedDict", "collections.OrderedDict", PK_G_ORDERED_DICT, CKPT_OTHER},
    {"torch._utils", "_rebuild_tensor_v2", "torch._utils._rebuild_tensor_v2",
     PK_G_REBUILD_TENSOR_V2, CKPT_OTHER},
    {"torch._utils", "_rebuild_parameter", "torch._utils._rebuild_parameter",
     PK_G_REBUILD_PARAMETER, CKPT_OTHER},
    {"torch._utils", "_rebuild_parameter_with_state", "torch._utils._rebuild_parameter_with_state",
     PK_G_REBUILD_PARAMETER_STATE, CKPT_OTHER},
    {"torch", "HalfStorage", "torch.HalfStorage", PK_G_STORAGE_TYPE, CKPT_F16},
    {"torch", "FloatStorage", "torch.FloatStorage", PK_G_STORAGE_TYPE, CKPT_F32},
    {"torch", "BFloat16Storage", "torch.BFloat16Storage", PK_G_STORAGE_TYPE, CKPT_BF16},
    {"torch", "DoubleStorage", "torch.DoubleStorage", PK_G_STORAGE_TYPE, CKPT_F64},
    {"torch", "LongStorage", "torch.LongStorage", PK_G_STORAGE_TYPE, CKPT_I64},
    {"torch", "IntStorage", "torch.IntStorage", PK_G_STORAGE_TYPE, CKPT_I32},
    {"torch", "ShortStorage", "torch.ShortStorage", PK_G_STORAGE_TYPE, CKPT_I16},
    {"torch", "CharStorage", "torch.CharStorage", PK_G_STORAGE_TYPE, CKPT_I8},
    {"torch", "ByteStorage", "torch.ByteStorage", PK_G_STORAGE_TYPE, CKPT_U8},
    {"torch", "BoolStorage", "torch.BoolStorage", PK_G_STORAGE_TYPE, CKPT_BOOL},
};

const char *pk_kind_name(pk_kind k) {
    static const char *names[] = {"None", "bool", "int",    "float",   "str",   "tuple",
                                  "list", "dict", "global", "storage", "tensor"};
    return (unsigned)k < sizeof names / sizeof names[0] ? names[k] : "?";
}

static int fail(unpickler *u, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(unpickler *u, const char *fmt, ...) {
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return pd_fail(u->err, "pickle byte %zu (opcode 0x%02x): %s", u->op_at, u->op, msg);
}

/* Copy at most 80 bytes of s into dst (cap >= 84), replacing unprintables. */
static const char *printable(char *dst, const char *s, size_t len) {
    size_t n = len > 80 ? 80 : len, j = 0;
    for (size_t i = 0; i < n; i++)
        dst[j++] = (s[i] >= 0x20 && s[i] < 0x7f) ? s[i] : '?';
    if (n < len) dst[j++] = '.', dst[j++] = '.', dst[j++] = '.';
    dst[j] = 0;
    return dst;
}

/* ---- values and the arena ---- */

static pk_value *new_value(unpickler *u, pk_kind kind) {
    pk_arena *a = u->arena;
    if (a->n == PK_MAX_VALUES) {
        fail(u, "more than %u values: refusing to go on", PK_MAX_VALUES);
        return NULL;
    }
    if (a->n == a->cap) {
        size_t cap = a->cap ? a->cap * 2 : 256;
        pk_value **v = realloc(a->values, cap * sizeof *v);
        if (!v) {
            fail(u, "out of memory");
            return NULL;
        }
        a->values = v;
        a->cap = cap;
    }
    pk_value *v = calloc(1, sizeof *v);
    if (!v) {
        fail(u, "out of memory");
        return NULL;
    }
    v->kind = kind;
    a->values[a->n++] = v;
    return v;
}

void pk_arena_free(pk_arena *a) {
    for (size_t i = 0; i < a->n; i++) {
        pk_value *v = a->values[i];
        if (v->kind == PK_STR) free(v->u.str.s);
        if (v->kind == PK_TUPLE || v->kind == PK_LIST || v->kind == PK_DICT) free(v->u.seq.items);
        if (v->kind == PK_STORAGE) free(v->u.storage.key);
        free(v);
    }
    free(a->values);
    a->values = NULL;
    a->n = a->cap = 0;
}

/* Append one slot to a tuple/list/dict's item array. */
static int seq_add(unpickler *u, pk_value *seq, pk_value *item) {
    if (seq->u.seq.n == seq->u.seq.cap) {
        size_t cap = seq->u.seq.cap ? seq->u.seq.cap * 2 : 4;
        pk_value **items = realloc(seq->u.seq.items, cap * sizeof *items);
        if (!items) return fail(u, "out of memory");
        seq->u.seq.items = items;
        seq->u.seq.cap = cap;
    }
    seq->u.seq.items[seq->u.seq.n++] = item;
    return 0;
}

/* ---- the stack ---- */

static size_t stack_floor(const unpickler *u) {
    return u->n_marks ? u->marks[u->n_marks - 1] : 0;
}

static int push(unpickler *u, pk_value *v) {
    if (!v) return -1; /* new_value already failed */
    if (u->sp == PK_MAX_STACK) return fail(u, "stack deeper than %u values", PK_MAX_STACK);
    if (u->sp == u->stack_cap) {
        size_t cap = u->stack_cap ? u->stack_cap * 2 : 64;
        pk_value **s = realloc(u->stack, cap * sizeof *s);
        if (!s) return fail(u, "out of memory");
        u->stack = s;
        u->stack_cap = cap;
    }
    u->stack[u->sp++] = v;
    return 0;
}

static pk_value *pop(unpickler *u) {
    if (u->sp == stack_floor(u)) {
        fail(u, "stack underflow");
        return NULL;
    }
    return u->stack[--u->sp];
}

static pk_value *top(unpickler *u) {
    if (u->sp == stack_floor(u)) {
        fail(u, "stack underflow");
        return NULL;
    }
    return u->stack[u->sp - 1];
}

/* End the innermost MARK; *base is where its items start on the stack. */
static int pop_mark(unpickler *u, size_t *base) {
    if (u->n_marks == 0) return fail(u, "no MARK to end");
    *base = u->marks[--u->n_marks];
    return 0;
}

/* ---- reading opcode arguments ---- */

static int take(unpickler *u, uint64_t n, const uint8_t **out) {
    if (n > u->len - u->pos)
        return fail(u, "argument of %llu bytes runs past the end of the pickle",
                    (unsigned long long)n);
    *out = u->p + u->pos;
    u->pos += n;
    return 0;
}

static int take_uint(unpickler *u, int bytes, uint64_t *out) {
    const uint8_t *b = NULL;
    if (take(u, (uint64_t)bytes, &b) != 0) return -1;
    uint64_t v = 0;
    for (int i = bytes - 1; i >= 0; i--)
        v = (v << 8) | b[i];
    *out = v;
    return 0;
}

static pk_value *make_int(unpickler *u, int64_t i) {
    pk_value *v = new_value(u, PK_INT);
    if (v) v->u.i = i;
    return v;
}

static pk_value *make_str(unpickler *u, const uint8_t *s, uint64_t len) {
    pk_value *v = new_value(u, PK_STR);
    if (!v) return NULL;
    v->u.str.s = malloc(len + 1);
    if (!v->u.str.s) {
        v->kind = PK_NONE;
        fail(u, "out of memory for a %llu-byte string", (unsigned long long)len);
        return NULL;
    }
    memcpy(v->u.str.s, s, len);
    v->u.str.s[len] = 0;
    v->u.str.len = len;
    return v;
}

/* A string opcode whose argument is a `bytes`-byte length then the data. */
static int op_string(unpickler *u, int bytes, int is_signed) {
    uint64_t n = 0;
    const uint8_t *s = NULL;
    if (take_uint(u, bytes, &n) != 0) return -1;
    if (is_signed && (n & 0x80000000u)) return fail(u, "negative string length");
    if (take(u, n, &s) != 0) return -1;
    return push(u, make_str(u, s, n));
}

/* LONG1/LONG4: little-endian two's complement of n bytes; we keep int64. */
static int op_long(unpickler *u, int len_bytes) {
    uint64_t n = 0;
    const uint8_t *b = NULL;
    if (take_uint(u, len_bytes, &n) != 0) return -1;
    if (n > 8)
        return fail(u, "integer of %llu bytes does not fit in 64 bits", (unsigned long long)n);
    if (take(u, n, &b) != 0) return -1;
    uint64_t v = 0;
    for (int i = (int)n - 1; i >= 0; i--)
        v = (v << 8) | b[i];
    if (n > 0 && n < 8 && (b[n - 1] & 0x80)) v |= ~(uint64_t)0 << (8 * n); /* sign-extend */
    return push(u, make_int(u, (int64_t)v));
}

/* ---- memo ---- */

static int memo_put(unpickler *u, uint64_t idx) {
    pk_value *v = top(u);
    if (!v) return -1;
    /* CPython numbers memo entries 0, 1, 2, ...: an index beyond the pickle's
     * length can only come from a hostile file, and would cost memory. */
    if (idx > u->len)
        return fail(u, "memo index %llu is implausibly large", (unsigned long long)idx);
    if (idx >= u->memo_cap) {
        size_t cap = u->memo_cap ? u->memo_cap : 64;
        while (cap <= idx)
            cap *= 2;
        pk_value **m = realloc(u->memo, cap * sizeof *m);
        if (!m) return fail(u, "out of memory");
        memset(m + u->memo_cap, 0, (cap - u->memo_cap) * sizeof *m);
        u->memo = m;
        u->memo_cap = cap;
    }
    if (!u->memo[idx]) u->memo_set++;
    u->memo[idx] = v;
    return 0;
}

static int memo_get(unpickler *u, uint64_t idx) {
    if (idx >= u->memo_cap || !u->memo[idx])
        return fail(u, "memo index %llu was never stored", (unsigned long long)idx);
    return push(u, u->memo[idx]);
}

/* ---- globals and the calls we interpret ---- */

static int push_global(unpickler *u, const char *mod, size_t mod_len, const char *name,
                       size_t name_len) {
    for (size_t i = 0; i < sizeof allowed_globals / sizeof allowed_globals[0]; i++) {
        if (strlen(allowed_globals[i].module) == mod_len &&
            memcmp(allowed_globals[i].module, mod, mod_len) == 0 &&
            strlen(allowed_globals[i].name) == name_len &&
            memcmp(allowed_globals[i].name, name, name_len) == 0) {
            pk_value *v = new_value(u, PK_GLOBAL);
            if (!v) return -1;
            v->u.global.which = allowed_globals[i].which;
            v->u.global.dtype = allowed_globals[i].dtype;
            v->u.global.qualname = allowed_globals[i].qualname;
            return push(u, v);
        }
    }
    char m[84], n[84];
    return fail(
        u, "refusing to unpickle global %s.%s (only what a tensor state dict needs is allowed)",
        printable(m, mod, mod_len), printable(n, name, name_len));
}

/* GLOBAL's argument: "module\nname\n". */
static int op_global(unpickler *u) {
    const char *parts[2];
    size_t lens[2];
    for (int k = 0; k < 2; k++) {
        const uint8_t *start = u->p + u->pos;
        const uint8_t *nl = memchr(start, '\n', u->len - u->pos);
        if (!nl) return fail(u, "GLOBAL name is not newline-terminated");
        parts[k] = (const char *)start;
        lens[k] = (size_t)(nl - start);
        u->pos += lens[k] + 1;
    }
    return push_global(u, parts[0], lens[0], parts[1], lens[1]);
}

static int op_stack_global(unpickler *u) {
    pk_value *name = pop(u);
    if (!name) return -1;
    pk_value *mod = pop(u);
    if (!mod) return -1;
    if (mod->kind != PK_STR || name->kind != PK_STR)
        return fail(u, "STACK_GLOBAL needs two strings");
    return push_global(u, mod->u.str.s, mod->u.str.len, name->u.str.s, name->u.str.len);
}

static int get_int(const pk_value *v, int64_t *out) {
    if (v->kind != PK_INT && v->kind != PK_BOOL) return -1;
    *out = v->u.i;
    return 0;
}

/* A tuple of `ndim` non-negative ints into dims[]; returns ndim or -1. */
static int get_dims(const pk_value *v, int64_t *dims) {
    if (v->kind != PK_TUPLE || v->u.seq.n > CKPT_MAX_DIMS) return -1;
    for (size_t i = 0; i < v->u.seq.n; i++)
        if (get_int(v->u.seq.items[i], &dims[i]) != 0 || dims[i] < 0) return -1;
    return (int)v->u.seq.n;
}

/* _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad,
 * backward_hooks[, metadata]): record where the elements are; the hooks and
 * metadata do not change the data and are ignored. */
static int rebuild_tensor(unpickler *u, const pk_value *args) {
    if (args->u.seq.n != 6 && args->u.seq.n != 7)
        return fail(u, "_rebuild_tensor_v2 takes 6 or 7 arguments, got %zu", args->u.seq.n);
    pk_value **a = args->u.seq.items;
    pk_value *t = new_value(u, PK_TENSOR);
    if (!t) return -1;
    if (a[0]->kind != PK_STORAGE)
        return fail(u, "_rebuild_tensor_v2: first argument is a %s, not a storage",
                    pk_kind_name(a[0]->kind));
    t->u.tensor.storage = a[0];
    if (get_int(a[1], &t->u.tensor.offset) != 0 || t->u.tensor.offset < 0)
        return fail(u, "_rebuild_tensor_v2: storage offset is not a non-negative int");
    int nd = get_dims(a[2], t->u.tensor.size);
    if (nd < 0)
        return fail(u, "_rebuild_tensor_v2: size is not a tuple of at most %d non-negative ints",
                    CKPT_MAX_DIMS);
    if (get_dims(a[3], t->u.tensor.stride) != nd)
        return fail(u, "_rebuild_tensor_v2: stride is not a tuple of %d non-negative ints", nd);
    int64_t dummy;
    if (get_int(a[4], &dummy) != 0)
        return fail(u, "_rebuild_tensor_v2: requires_grad is not a bool");
    t->u.tensor.ndim = nd;
    return push(u, t);
}

static int op_reduce(unpickler *u) {
    pk_value *args = pop(u);
    if (!args) return -1;
    pk_value *fn = pop(u);
    if (!fn) return -1;
    if (fn->kind != PK_GLOBAL)
        return fail(u, "REDUCE on a %s, not a whitelisted global", pk_kind_name(fn->kind));
    if (args->kind != PK_TUPLE)
        return fail(u, "REDUCE arguments are a %s, not a tuple", pk_kind_name(args->kind));
    size_t n = args->u.seq.n;
    switch (fn->u.global.which) {
    case PK_G_ORDERED_DICT:
        if (n != 0) return fail(u, "OrderedDict() with arguments is not supported");
        return push(u, new_value(u, PK_DICT));
    case PK_G_REBUILD_TENSOR_V2:
        return rebuild_tensor(u, args);
    case PK_G_REBUILD_PARAMETER:
    case PK_G_REBUILD_PARAMETER_STATE:
        /* A Parameter is its tensor plus requires_grad (and hooks/state): keep the tensor. */
        if (n != (fn->u.global.which == PK_G_REBUILD_PARAMETER ? 3u : 4u) ||
            args->u.seq.items[0]->kind != PK_TENSOR)
            return fail(u, "%s: unexpected arguments", fn->u.global.qualname);
        return push(u, args->u.seq.items[0]);
    case PK_G_STORAGE_TYPE:
        break;
    }
    return fail(u, "calling %s is not supported", fn->u.global.qualname);
}

/* BINPERSID on ('storage', torch.<T>Storage, key, location, numel): a
 * reference to the archive entry data/<key>, read by the caller. */
static int op_persid(unpickler *u) {
    pk_value *pid = pop(u);
    if (!pid) return -1;
    pk_value **a = pid->u.seq.items;
    int64_t numel;
    if (pid->kind != PK_TUPLE || pid->u.seq.n != 5 || a[0]->kind != PK_STR ||
        strcmp(a[0]->u.str.s, "storage") != 0)
        return fail(u, "persistent id is not a ('storage', type, key, location, numel) tuple");
    if (a[1]->kind != PK_GLOBAL || a[1]->u.global.which != PK_G_STORAGE_TYPE)
        return fail(u, "persistent id: storage type is not a torch.<Type>Storage");
    if (a[2]->kind != PK_STR || a[2]->u.str.len == 0 || strlen(a[2]->u.str.s) != a[2]->u.str.len ||
        a[3]->kind != PK_STR)
        return fail(u, "persistent id: storage key or location is not a string");
    if (get_int(a[4], &numel) != 0 || numel < 0)
        return fail(u, "persistent id: storage size is not a non-negative int");
    pk_value *s = new_value(u, PK_STORAGE);
    if (!s) return -1;
    s->u.storage.key = strdup(a[2]->u.str.s);
    if (!s->u.storage.key) {
        s->kind = PK_NONE;
        return fail(u, "out of memory");
    }
    s->u.storage.dtype = a[1]->u.global.dtype;
    s->u.storage.numel = numel;
    return push(u, s);
}

/* ---- containers ---- */

static int op_tuple_n(unpickler *u, int n) {
    pk_value *items[3];
    for (int i = n - 1; i >= 0; i--)
        if (!(items[i] = pop(u))) return -1;
    pk_value *t = new_value(u, PK_TUPLE);
    if (!t) return -1;
    for (int i = 0; i < n; i++)
        if (seq_add(u, t, items[i]) != 0) return -1;
    return push(u, t);
}

/* TUPLE, LIST, DICT: a new container from the items since the last MARK. */
static int op_from_mark(unpickler *u, pk_kind kind) {
    size_t base = 0;
    if (pop_mark(u, &base) != 0) return -1;
    if (kind == PK_DICT && (u->sp - base) % 2 != 0)
        return fail(u, "odd number of items for a dict");
    pk_value *c = new_value(u, kind);
    if (!c) return -1;
    for (size_t i = base; i < u->sp; i++)
        if (seq_add(u, c, u->stack[i]) != 0) return -1;
    u->sp = base;
    return push(u, c);
}

/* APPENDS, SETITEMS: add the items since the last MARK to the container
 * just below the mark. */
static int op_add_from_mark(unpickler *u, pk_kind kind) {
    size_t base = 0;
    if (pop_mark(u, &base) != 0) return -1;
    if (base == stack_floor(u)) return fail(u, "no container below the MARK");
    pk_value *c = u->stack[base - 1];
    if (c->kind != kind)
        return fail(u, "%s applied to a %s", kind == PK_LIST ? "APPENDS" : "SETITEMS",
                    pk_kind_name(c->kind));
    if (kind == PK_DICT && (u->sp - base) % 2 != 0)
        return fail(u, "odd number of items for SETITEMS");
    for (size_t i = base; i < u->sp; i++)
        if (seq_add(u, c, u->stack[i]) != 0) return -1;
    u->sp = base;
    return 0;
}

static int op_append(unpickler *u) {
    pk_value *v = pop(u);
    if (!v) return -1;
    pk_value *list = top(u);
    if (!list) return -1;
    if (list->kind != PK_LIST) return fail(u, "APPEND to a %s", pk_kind_name(list->kind));
    return seq_add(u, list, v);
}

static int op_setitem(unpickler *u) {
    pk_value *v = pop(u);
    if (!v) return -1;
    pk_value *k = pop(u);
    if (!k) return -1;
    pk_value *d = top(u);
    if (!d) return -1;
    if (d->kind != PK_DICT) return fail(u, "SETITEM on a %s", pk_kind_name(d->kind));
    if (seq_add(u, d, k) != 0) return -1;
    return seq_add(u, d, v);
}

/* ---- the loop ---- */

static int step(unpickler *u, pk_value **result, int *done) {
    uint64_t n = 0;
    size_t base = 0;
    pk_value *v;
    double f;
    const uint8_t *b = NULL;
    u->op_at = u->pos;
    u->op = u->p[u->pos++];
    switch (u->op) {
    case 0x80: /* PROTO */
        if (take_uint(u, 1, &n) != 0) return -1;
        if (n > 5) return fail(u, "pickle protocol %llu is newer than 5", (unsigned long long)n);
        return 0;
    case 0x95:
        return take_uint(u, 8, &n); /* FRAME: a length hint only */
    case '.':                       /* STOP */
        if (!(*result = pop(u))) return -1;
        *done = 1;
        return 0;
    case '(': /* MARK */
        if (u->n_marks == PK_MAX_MARKS) return fail(u, "MARKs nested deeper than %d", PK_MAX_MARKS);
        u->marks[u->n_marks++] = u->sp;
        return 0;
    case '0': /* POP: like CPython, an empty region pops its MARK instead */
        if (u->sp == stack_floor(u) && u->n_marks) return pop_mark(u, &base);
        return pop(u) ? 0 : -1;
    case '1': /* POP_MARK */
        if (pop_mark(u, &base) != 0) return -1;
        u->sp = base;
        return 0;
    case '2':
        return (v = top(u)) ? push(u, v) : -1; /* DUP */
    case 'N':
        return push(u, new_value(u, PK_NONE));
    case 0x88:
    case 0x89: /* NEWTRUE, NEWFALSE */
        if (!(v = new_value(u, PK_BOOL))) return -1;
        v->u.i = u->op == 0x88;
        return push(u, v);
    case 'J': /* BININT: signed 32-bit */
        if (take_uint(u, 4, &n) != 0) return -1;
        return push(u, make_int(u, (int32_t)(uint32_t)n));
    case 'K':
        if (take_uint(u, 1, &n) != 0) return -1;
        return push(u, make_int(u, (int64_t)n));
    case 'M':
        if (take_uint(u, 2, &n) != 0) return -1;
        return push(u, make_int(u, (int64_t)n));
    case 0x8a:
        return op_long(u, 1);
    case 0x8b:
        return op_long(u, 4);
    case 'G': /* BINFLOAT: big-endian IEEE double */
        if (take(u, 8, &b) != 0) return -1;
        n = 0;
        for (int i = 0; i < 8; i++)
            n = (n << 8) | b[i];
        memcpy(&f, &n, sizeof f);
        if (!(v = new_value(u, PK_FLOAT))) return -1;
        v->u.f = f;
        return push(u, v);
    case 'X':
        return op_string(u, 4, 0); /* BINUNICODE */
    case 0x8c:
        return op_string(u, 1, 0); /* SHORT_BINUNICODE */
    case 0x8d:
        return op_string(u, 8, 0); /* BINUNICODE8 */
    case 'T':
        return op_string(u, 4, 1); /* BINSTRING */
    case 'U':
        return op_string(u, 1, 0); /* SHORT_BINSTRING */
    case 'B':
        return op_string(u, 4, 0); /* BINBYTES */
    case 'C':
        return op_string(u, 1, 0); /* SHORT_BINBYTES */
    case 0x8e:
        return op_string(u, 8, 0); /* BINBYTES8 */
    case ')':
        return push(u, new_value(u, PK_TUPLE));
    case 't':
        return op_from_mark(u, PK_TUPLE);
    case 0x85:
        return op_tuple_n(u, 1);
    case 0x86:
        return op_tuple_n(u, 2);
    case 0x87:
        return op_tuple_n(u, 3);
    case ']':
        return push(u, new_value(u, PK_LIST));
    case 'l':
        return op_from_mark(u, PK_LIST);
    case 'a':
        return op_append(u);
    case 'e':
        return op_add_from_mark(u, PK_LIST);
    case '}':
        return push(u, new_value(u, PK_DICT));
    case 'd':
        return op_from_mark(u, PK_DICT);
    case 's':
        return op_setitem(u);
    case 'u':
        return op_add_from_mark(u, PK_DICT);
    case 'c':
        return op_global(u);
    case 0x93:
        return op_stack_global(u);
    case 'R':
        return op_reduce(u);
    case 'b': /* BUILD: set state on the object below; we keep no object state */
        if (!pop(u)) return -1;
        return top(u) ? 0 : -1;
    case 'Q':
        return op_persid(u);
    case 'q':
        if (take_uint(u, 1, &n) != 0) return -1;
        return memo_put(u, n);
    case 'r':
        if (take_uint(u, 4, &n) != 0) return -1;
        return memo_put(u, n);
    case 0x94:
        return memo_put(u, u->memo_set); /* MEMOIZE: next index = memo size */
    case 'h':
        if (take_uint(u, 1, &n) != 0) return -1;
        return memo_get(u, n);
    case 'j':
        if (take_uint(u, 4, &n) != 0) return -1;
        return memo_get(u, n);
    default:
        return fail(u, "unsupported pickle opcode");
    }
}

int pk_load(const uint8_t *data, size_t len, pk_arena *arena, pk_value **out, pd_err *err) {
    unpickler u = {.p = data, .len = len, .arena = arena, .err = err};
    int done = 0, rc = 0;
    *out = NULL;
    while (!done) {
        if (u.pos >= u.len) {
            rc = pd_fail(err, "pickle ends at byte %zu without STOP: truncated?", u.len);
            break;
        }
        if (step(&u, out, &done) != 0) {
            rc = -1;
            break;
        }
    }
    free(u.stack);
    free(u.memo);
    if (rc != 0) *out = NULL;
    return rc;
}
