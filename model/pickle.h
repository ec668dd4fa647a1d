/* pickle: a restricted unpickler for the pickles inside torch.save files.
 *
 * It reads the opcode stream into a tree of small tagged values and never
 * runs anything: GLOBAL may only name the handful of callables a state dict
 * uses (OrderedDict, torch._utils._rebuild_tensor_v2 / _rebuild_parameter,
 * torch.<Type>Storage), and REDUCE on them is interpreted here — it builds an
 * empty dict, a tensor description, or unwraps a parameter. Anything else is
 * an error naming the global or opcode. Every value lives in one arena that
 * pk_arena_free releases; nothing here recurses, so nesting depth cannot blow
 * the C stack, and the stack, mark and memo sizes are capped. */
#ifndef PD_MODEL_PICKLE_H
#define PD_MODEL_PICKLE_H

#include <stddef.h>
#include <stdint.h>

#include "common/pd_common.h"
#include "model/checkpoint.h"

typedef enum {
    PK_NONE,
    PK_BOOL,
    PK_INT,
    PK_FLOAT,
    PK_STR,
    PK_TUPLE,
    PK_LIST,
    PK_DICT,
    PK_GLOBAL,
    PK_STORAGE,
    PK_TENSOR
} pk_kind;

/* The whitelisted globals. */
typedef enum {
    PK_G_ORDERED_DICT,
    PK_G_REBUILD_TENSOR_V2,
    PK_G_REBUILD_PARAMETER,
    PK_G_REBUILD_PARAMETER_STATE,
    PK_G_STORAGE_TYPE
} pk_global;

typedef struct pk_value pk_value;
struct pk_value {
    pk_kind kind;
    union {
        int64_t i; /* PK_BOOL (0/1), PK_INT */
        double f;
        struct {
            char *s; /* NUL-terminated copy; len excludes the NUL (may hold NULs itself) */
            size_t len;
        } str;
        struct {
            pk_value **items; /* PK_TUPLE, PK_LIST: n items; PK_DICT: n/2 pairs, key then value */
            size_t n, cap;
        } seq;
        struct {
            pk_global which;
            ckpt_dtype dtype;     /* for PK_G_STORAGE_TYPE */
            const char *qualname; /* "module.name", static */
        } global;
        struct {
            ckpt_dtype dtype;
            char *key; /* storage key: the archive entry is <prefix>/data/<key> */
            int64_t numel;
        } storage;
        struct {
            pk_value *storage; /* a PK_STORAGE */
            int64_t offset;    /* in elements */
            int ndim;
            int64_t size[CKPT_MAX_DIMS], stride[CKPT_MAX_DIMS];
        } tensor;
    } u;
};

/* Owns every value created while unpickling. */
typedef struct pk_arena {
    pk_value **values;
    size_t n, cap;
} pk_arena;

/* Limits on what a pickle may make us hold (exceeding one is an error). */
#define PK_MAX_STACK (1u << 20) /* values on the stack at once */
#define PK_MAX_MARKS 256        /* nested MARKs */
#define PK_MAX_VALUES (1u << 24)

/* Unpickle data[0..len). On success *out is the object STOP returned, owned
 * by arena. Errors name the opcode and its byte offset in the pickle. Call
 * pk_arena_free(arena) afterwards in both cases. */
int pk_load(const uint8_t *data, size_t len, pk_arena *arena, pk_value **out, pd_err *err);
void pk_arena_free(pk_arena *arena);

/* "int", "tuple", ... for messages. */
const char *pk_kind_name(pk_kind k);

#endif
