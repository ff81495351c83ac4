/* connector.events._node_table: the index's node table (block hash -> node) in C.
 *
 * Rules it keeps (connector/events/node_table.py is the Python face):
 *
 * - A NodeTable behaves as a dict for every key. Keys that are ints in [0, 2**64) (ints by
 *   value: int subclasses, integral floats and __index__ types too, as a dict would find
 *   them) live inline in an open-addressing table: linear probing, a power-of-two
 *   capacity, grown past 5/8 load and shrunk under 1/8, deletion by backward shift (no
 *   tombstones), slots placed by splitmix64's finalizer (an int hashes to itself in
 *   Python: consecutive keys would sit in neighbouring slots and cluster). Every other key
 *   (bytes digests, negatives, 2**64 and up, strings) lives in a plain dict beside it.
 * - A slot is 24 bytes: the key and a 128-bit value word (lo, hi) side by side, so a probe
 *   reads one cache line (two where a slot straddles). lo == 0: an empty slot; lo odd: an
 *   int v in [0, 2**127) stored inline as (v << 1 | 1) (nodes of up to 95 lanes); else lo is
 *   a strong reference to the object (wider ints, dict nodes, anything else).
 * - Iteration order is slot order, not insertion order. An iterator raises RuntimeError
 *   when a key came or went since it started (a dict raises when its size changed).
 * - lane_groups(table, ends, b) is index.lane_groups' walk in one C pass (prefetching the
 *   slots ahead); it returns None when a node is not an int below 2**127 (the caller then
 *   walks in Python). No pickling; GC sees every object held. Needs a compiler with
 *   unsigned __int128 (GCC, Clang): elsewhere the build fails and the index uses a dict.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#ifndef __SIZEOF_INT128__
#error "the node table needs unsigned __int128 (the index falls back to a dict)"
#endif
typedef unsigned __int128 u128;

typedef struct {
    uint64_t key;
    uint64_t lo; /* 0 empty; odd: inline int (with hi); else PyObject * */
    uint64_t hi;
} Slot;

typedef struct {
    PyObject_HEAD
    Slot *slots;
    size_t mask;        /* capacity - 1 */
    Py_ssize_t used;    /* live slots */
    Py_ssize_t nobj;    /* slots whose value is an object */
    PyObject *fallback; /* dict of the other keys, or NULL */
    uint64_t mutations; /* keys added or removed (iterators check it) */
} NodeTable;

#define MIN_CAP 8
#define IS_INLINE(lo) ((lo) & 1)
#define AS_OBJ(lo) ((PyObject *)(uintptr_t)(lo))
#define INLINE_VALUE(s) ((((u128)(s)->hi << 64) | (s)->lo) >> 1)

static PyTypeObject NodeTable_Type;
static PyTypeObject View_Type;
static PyTypeObject Iter_Type;

static inline uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* -- keys and values --------------------------------------------------------------------- */

/* An int in [0, 2**64): 1 and *out; else 0 (no error set). */
static inline int long_u64(PyObject *k, uint64_t *out)
{
    int overflow;
    long long x = PyLong_AsLongLongAndOverflow(k, &overflow);
    if (!overflow) {
        if (x < 0)
            return 0;
        *out = (uint64_t)x;
        return 1;
    }
    if (overflow < 0)
        return 0;
#if PY_VERSION_HEX >= 0x030D0000
    Py_ssize_t n = PyLong_AsNativeBytes(k, out, 8, Py_ASNATIVEBYTES_NATIVE_ENDIAN |
                                        Py_ASNATIVEBYTES_UNSIGNED_BUFFER);
    if (n < 0)
        PyErr_Clear();
    return n >= 0 && n <= 8;
#else
    if (_PyLong_NumBits(k) > 64)
        return 0;
    *out = PyLong_AsUnsignedLongLongMask(k); /* in range: the value itself */
    return 1;
#endif
}

/* long_u64 for an exact int, reading its 30-bit digits where this CPython's layout is known
 * (3.11: the size is the signed digit count; 3.12, 3.13: lv_tag); else long_u64. */
static inline int exact_long_u64(PyObject *k, uint64_t *out)
{
#if PYLONG_BITS_IN_DIGIT == 30 && PY_VERSION_HEX < 0x030C0000
    Py_ssize_t size = Py_SIZE(k);
    const digit *d = ((PyLongObject *)k)->ob_digit;
#elif PYLONG_BITS_IN_DIGIT == 30 && PY_VERSION_HEX < 0x030E0000
    uintptr_t tag = ((PyLongObject *)k)->long_value.lv_tag;
    Py_ssize_t size = (tag & 3) == 2 ? -1 : (Py_ssize_t)(tag >> 3);
    const digit *d = ((PyLongObject *)k)->long_value.ob_digit;
#else
    return long_u64(k, out);
#endif
#if PYLONG_BITS_IN_DIGIT == 30 && PY_VERSION_HEX < 0x030E0000
    switch (size) {
    case 0:
        *out = 0;
        return 1;
    case 1:
        *out = d[0];
        return 1;
    case 2:
        *out = d[0] | (uint64_t)d[1] << 30;
        return 1;
    case 3:
        if (d[2] >> 4)
            return 0; /* 2**64 and up */
        *out = d[0] | (uint64_t)d[1] << 30 | (uint64_t)d[2] << 60;
        return 1;
    default:
        return 0; /* negative, or 2**90 and up */
    }
#endif
}

/* 1: key is the int *out of [0, 2**64); 0: not such an int (the fallback dict's); -1: error. */
static int key_u64(PyObject *k, uint64_t *out)
{
    if (PyLong_CheckExact(k))
        return exact_long_u64(k, out);
    if (PyLong_Check(k))
        return long_u64(k, out);
    if (PyFloat_CheckExact(k)) {
        double d = PyFloat_AS_DOUBLE(k);
        if (d >= 0.0 && d < 18446744073709551616.0 && d == floor(d)) {
            *out = (uint64_t)d;
            return 1;
        }
        return 0;
    }
    if (PyIndex_Check(k)) { /* numpy ints and friends: a dict finds them by value */
        PyObject *i = PyNumber_Index(k);
        int r;
        if (i == NULL) {
            PyErr_Clear();
            return 0;
        }
        r = key_u64(i, out);
        Py_DECREF(i);
        return r;
    }
    return 0;
}

/* Little-endian two's complement bytes of an int: 0, or -1 when it needs more than 16. */
static int long_bytes16(PyObject *v, unsigned char *buf)
{
#if PY_VERSION_HEX >= 0x030D0000
    Py_ssize_t n = PyLong_AsNativeBytes(v, buf, 16, Py_ASNATIVEBYTES_LITTLE_ENDIAN);
    if (n < 0)
        PyErr_Clear();
    return n >= 0 && n <= 16 ? 0 : -1;
#else
    if (_PyLong_AsByteArray((PyLongObject *)v, buf, 16, 1, 1) < 0) {
        PyErr_Clear();
        return -1;
    }
    return 0;
#endif
}

static PyObject *u128_to_long(u128 x)
{
    if (!(x >> 64))
        return PyLong_FromUnsignedLongLong((unsigned long long)x);
    unsigned char buf[16];
    int i;
    for (i = 0; i < 16; i++)
        buf[i] = (unsigned char)(x >> (8 * i));
#if PY_VERSION_HEX >= 0x030D0000
    return PyLong_FromUnsignedNativeBytes(buf, 16, Py_ASNATIVEBYTES_LITTLE_ENDIAN);
#else
    return _PyLong_FromByteArray(buf, 16, 1, 0);
#endif
}

/* An exact int (only) in [0, 2**127): 1 and *out; else 0; -1 on error. */
static int long_u127(PyObject *v, u128 *out)
{
    int overflow, i;
    uint64_t u;
    if (exact_long_u64(v, &u)) { /* below 2**64: the common node */
        *out = u;
        return 1;
    }
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (x == -1 && PyErr_Occurred())
        return -1;
    if (!overflow) {
        *out = (u128)(uint64_t)x;
        return x >= 0;
    }
    unsigned char buf[16];
    if (overflow < 0 || long_bytes16(v, buf) < 0)
        return 0;
    *out = 0;
    for (i = 15; i >= 0; i--)
        *out = (*out << 8) | buf[i];
    return !(*out >> 127);
}

/* The value words of v in a slot: inline for an exact int in [0, 2**127), else a new
 * reference. -1 on error. */
static int val_encode(PyObject *v, Slot *s)
{
    if (PyLong_CheckExact(v)) {
        u128 x;
        int r = long_u127(v, &x);
        if (r < 0)
            return -1;
        if (r) {
            x = (x << 1) | 1;
            s->lo = (uint64_t)x;
            s->hi = (uint64_t)(x >> 64);
            return 0;
        }
    }
    Py_INCREF(v);
    s->lo = (uint64_t)(uintptr_t)v;
    s->hi = 0;
    return 0;
}

static inline PyObject *val_decode(const Slot *s)
{
    if (IS_INLINE(s->lo))
        return s->hi ? u128_to_long(INLINE_VALUE(s)) : PyLong_FromUnsignedLongLong(s->lo >> 1);
    Py_INCREF(AS_OBJ(s->lo));
    return AS_OBJ(s->lo);
}

static PyObject *key_decode(uint64_t k) { return PyLong_FromUnsignedLongLong(k); }

/* -- the open-addressing table ----------------------------------------------------------- */

/* Slot arrays: small ones from PyMem; big ones mapped on their own, 2 MiB-aligned and
 * advised to transparent huge pages where the kernel has them (a probe is a cache miss;
 * with 4 KiB pages it is a TLB miss too). Both are traced by tracemalloc. */
#define HUGE_BYTES ((size_t)2 << 20)

static Slot *slots_alloc(size_t cap)
{
    size_t bytes = cap * sizeof(Slot);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (bytes >= HUGE_BYTES) {
        size_t len = bytes + HUGE_BYTES;
        char *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        char *a;
        if (p == MAP_FAILED)
            return NULL;
        a = (char *)(((uintptr_t)p + HUGE_BYTES - 1) & ~(uintptr_t)(HUGE_BYTES - 1));
        if (a > p)
            munmap(p, (size_t)(a - p));
        if (p + len > a + bytes)
            munmap(a + bytes, (size_t)(p + len - (a + bytes)));
        (void)madvise(a, bytes, MADV_HUGEPAGE); /* advice only: fine if refused */
        (void)PyTraceMalloc_Track(0, (uintptr_t)a, bytes);
        return (Slot *)a;
    }
#endif
    return PyMem_Calloc(cap, sizeof(Slot));
}

static void slots_free(Slot *slots, size_t cap)
{
    size_t bytes = cap * sizeof(Slot);
    if (slots == NULL)
        return;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (bytes >= HUGE_BYTES && (uintptr_t)slots % HUGE_BYTES == 0) {
        (void)PyTraceMalloc_Untrack(0, (uintptr_t)slots);
        munmap(slots, bytes);
        return;
    }
#endif
    PyMem_Free(slots);
}

static inline Slot *find(NodeTable *t, uint64_t k)
{
    size_t mask = t->mask, i = (size_t)mix64(k) & mask;
    for (;;) {
        Slot *s = &t->slots[i];
        if (!s->lo)
            return NULL;
        if (s->key == k)
            return s;
        i = (i + 1) & mask;
    }
}

/* Capacity for n entries: the smallest power of two (>= MIN_CAP) at most half full. */
static size_t cap_for(Py_ssize_t n)
{
    size_t cap = MIN_CAP;
    while (cap < 2 * (size_t)n)
        cap <<= 1;
    return cap;
}

static int resize(NodeTable *t, size_t cap)
{
    Slot *old = t->slots, *slots;
    size_t old_cap = t->mask + 1, i, mask = cap - 1;
    slots = slots_alloc(cap);
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (i = 0; old != NULL && i < old_cap; i++) {
        if (old[i].lo) {
            size_t j = (size_t)mix64(old[i].key) & mask;
            while (slots[j].lo)
                j = (j + 1) & mask;
            slots[j] = old[i];
        }
    }
    t->slots = slots;
    t->mask = mask;
    slots_free(old, old_cap);
    return 0;
}

/* Set key k to the value words of v (a reference the table takes). 0, or -1 (not taken). */
static int put(NodeTable *t, uint64_t k, const Slot *v)
{
    Slot *s = find(t, k);
    size_t i;
    if (s != NULL) {
        uint64_t old = s->lo;
        s->lo = v->lo;
        s->hi = v->hi;
        t->nobj += !IS_INLINE(v->lo) - !IS_INLINE(old);
        if (!IS_INLINE(old))
            Py_DECREF(AS_OBJ(old));
        return 0;
    }
    if ((size_t)(t->used + 1) * 8 > (t->mask + 1) * 5 && resize(t, (t->mask + 1) * 2) < 0)
        return -1;
    i = (size_t)mix64(k) & t->mask;
    while (t->slots[i].lo)
        i = (i + 1) & t->mask;
    t->slots[i].key = k;
    t->slots[i].lo = v->lo;
    t->slots[i].hi = v->hi;
    t->used++;
    t->nobj += !IS_INLINE(v->lo);
    t->mutations++;
    return 0;
}

/* Empty slot s by backward shift; return its value words (the caller owns a reference). */
static Slot take(NodeTable *t, Slot *s)
{
    size_t mask = t->mask, i = (size_t)(s - t->slots), j = i;
    Slot v = *s;
    for (;;) {
        Slot *n;
        j = (j + 1) & mask;
        n = &t->slots[j];
        if (!n->lo)
            break;
        if ((((size_t)j - (size_t)mix64(n->key)) & mask) >= ((j - i) & mask)) {
            t->slots[i] = *n;
            i = j;
        }
    }
    memset(&t->slots[i], 0, sizeof(Slot));
    t->used--;
    t->nobj -= !IS_INLINE(v.lo);
    t->mutations++;
    if (t->mask + 1 > MIN_CAP && (size_t)t->used * 8 < t->mask + 1) {
        if (resize(t, cap_for(t->used + 1)) < 0)
            PyErr_Clear(); /* no memory for a smaller table: keep the big one */
    }
    return v;
}

static int fallback_dict(NodeTable *t)
{
    if (t->fallback == NULL && (t->fallback = PyDict_New()) == NULL)
        return -1;
    return 0;
}

/* A key neither table holds: dict's error for unhashable keys, else 0. */
static int check_hashable(PyObject *key) { return PyObject_Hash(key) == -1 ? -1 : 0; }

static void set_key_error(PyObject *key)
{
    PyObject *tup = PyTuple_Pack(1, key);
    if (tup != NULL) {
        PyErr_SetObject(PyExc_KeyError, tup);
        Py_DECREF(tup);
    }
}

/* New reference to table[key], NULL with no error set when missing, NULL + error on error. */
static PyObject *lookup(NodeTable *t, PyObject *key)
{
    uint64_t k;
    int r = key_u64(key, &k);
    if (r < 0)
        return NULL;
    if (r) {
        Slot *s = find(t, k);
        return s ? val_decode(s) : NULL;
    }
    if (t->fallback == NULL) {
        check_hashable(key);
        return NULL;
    }
    PyObject *v = PyDict_GetItemWithError(t->fallback, key);
    Py_XINCREF(v);
    return v;
}

static int store(NodeTable *t, PyObject *key, PyObject *value)
{
    uint64_t k;
    Slot v;
    int r = key_u64(key, &k);
    if (r < 0)
        return -1;
    if (r) {
        if (val_encode(value, &v) < 0)
            return -1;
        if (put(t, k, &v) < 0) {
            if (!IS_INLINE(v.lo))
                Py_DECREF(value);
            return -1;
        }
        return 0;
    }
    if (fallback_dict(t) < 0)
        return -1;
    Py_ssize_t before = PyDict_GET_SIZE(t->fallback);
    if (PyDict_SetItem(t->fallback, key, value) < 0)
        return -1;
    t->mutations += PyDict_GET_SIZE(t->fallback) != before;
    return 0;
}

/* New reference to the value popped, NULL with no error when missing, NULL + error. */
static PyObject *pop_key(NodeTable *t, PyObject *key)
{
    uint64_t k;
    int r = key_u64(key, &k);
    if (r < 0)
        return NULL;
    if (r) {
        Slot *s = find(t, k);
        if (s == NULL)
            return NULL;
        Slot v = take(t, s);
        if (IS_INLINE(v.lo))
            return val_decode(&v);
        return AS_OBJ(v.lo); /* the table's reference, handed over */
    }
    if (t->fallback == NULL) {
        check_hashable(key);
        return NULL;
    }
    PyObject *v = PyDict_GetItemWithError(t->fallback, key);
    if (v == NULL)
        return NULL;
    Py_INCREF(v);
    if (PyDict_DelItem(t->fallback, key) < 0) {
        Py_DECREF(v);
        return NULL;
    }
    t->mutations++;
    return v;
}

/* Drop every slot (objects released after the table is empty). */
static int clear_all(NodeTable *t)
{
    Slot *old = t->slots;
    size_t cap = t->mask + 1, i;
    PyObject *fb = t->fallback;
    Slot *fresh = slots_alloc(MIN_CAP);
    if (fresh == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    t->slots = fresh;
    t->mask = MIN_CAP - 1;
    t->used = 0;
    t->nobj = 0;
    t->fallback = NULL;
    t->mutations++;
    for (i = 0; old != NULL && i < cap; i++) {
        if (old[i].lo && !IS_INLINE(old[i].lo))
            Py_DECREF(AS_OBJ(old[i].lo));
    }
    slots_free(old, cap);
    Py_XDECREF(fb);
    return 0;
}

/* -- the type ------------------------------------------------------------------------------ */

static int update_from(NodeTable *t, PyObject *other);

static PyObject *NodeTable_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    NodeTable *t = (NodeTable *)type->tp_alloc(type, 0);
    if (t == NULL)
        return NULL;
    t->slots = slots_alloc(MIN_CAP);
    if (t->slots == NULL) {
        Py_DECREF(t);
        return PyErr_NoMemory();
    }
    t->mask = MIN_CAP - 1;
    return (PyObject *)t;
}

static int NodeTable_init(NodeTable *t, PyObject *args, PyObject *kwds)
{
    PyObject *other = NULL;
    if (kwds != NULL && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "NodeTable() takes no keyword arguments");
        return -1;
    }
    if (!PyArg_UnpackTuple(args, "NodeTable", 0, 1, &other))
        return -1;
    return other == NULL ? 0 : update_from(t, other);
}

static int NodeTable_traverse(NodeTable *t, visitproc visit, void *arg)
{
    Py_VISIT(t->fallback);
    if (t->nobj && t->slots != NULL) {
        size_t i, cap = t->mask + 1;
        for (i = 0; i < cap; i++) {
            uint64_t v = t->slots[i].lo;
            if (v && !IS_INLINE(v))
                Py_VISIT(AS_OBJ(v));
        }
    }
    return 0;
}

static int NodeTable_tp_clear(NodeTable *t)
{
    if (clear_all(t) < 0)
        PyErr_Clear();
    return 0;
}

static void NodeTable_dealloc(NodeTable *t)
{
    PyObject_GC_UnTrack(t);
    Py_TRASHCAN_BEGIN(t, NodeTable_dealloc)
    size_t i, cap = t->mask + 1;
    for (i = 0; t->slots != NULL && i < cap; i++) {
        if (t->slots[i].lo && !IS_INLINE(t->slots[i].lo))
            Py_DECREF(AS_OBJ(t->slots[i].lo));
    }
    slots_free(t->slots, cap);
    t->slots = NULL;
    Py_CLEAR(t->fallback);
    Py_TYPE(t)->tp_free((PyObject *)t);
    Py_TRASHCAN_END
}

static Py_ssize_t NodeTable_length(NodeTable *t)
{
    return t->used + (t->fallback ? PyDict_GET_SIZE(t->fallback) : 0);
}

static PyObject *NodeTable_subscript(NodeTable *t, PyObject *key)
{
    PyObject *v = lookup(t, key);
    if (v == NULL && !PyErr_Occurred())
        set_key_error(key);
    return v;
}

static int NodeTable_ass_subscript(NodeTable *t, PyObject *key, PyObject *value)
{
    if (value != NULL)
        return store(t, key, value);
    PyObject *v = pop_key(t, key);
    if (v == NULL) {
        if (!PyErr_Occurred())
            set_key_error(key);
        return -1;
    }
    Py_DECREF(v);
    return 0;
}

static int NodeTable_contains(NodeTable *t, PyObject *key)
{
    uint64_t k;
    int r = key_u64(key, &k);
    if (r < 0)
        return -1;
    if (r)
        return find(t, k) != NULL;
    if (t->fallback == NULL)
        return check_hashable(key);
    return PyDict_Contains(t->fallback, key);
}

static PyObject *NodeTable_get(NodeTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "get expected 1 or 2 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *v = lookup(t, args[0]);
    if (v == NULL && !PyErr_Occurred()) {
        v = nargs == 2 ? args[1] : Py_None;
        Py_INCREF(v);
    }
    return v;
}

static PyObject *NodeTable_pop(NodeTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "pop expected 1 or 2 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *v = pop_key(t, args[0]);
    if (v == NULL && !PyErr_Occurred()) {
        if (nargs == 1) {
            set_key_error(args[0]);
            return NULL;
        }
        v = args[1];
        Py_INCREF(v);
    }
    return v;
}

static PyObject *NodeTable_clear(NodeTable *t, PyObject *unused)
{
    if (clear_all(t) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static int update_pairs(NodeTable *t, PyObject *other)
{
    PyObject *it = PyObject_GetIter(other), *item;
    if (it == NULL)
        return -1;
    while ((item = PyIter_Next(it)) != NULL) {
        int r;
        if (PyTuple_CheckExact(item) && PyTuple_GET_SIZE(item) == 2) {
            r = store(t, PyTuple_GET_ITEM(item, 0), PyTuple_GET_ITEM(item, 1));
        } else {
            PyObject *fast = PySequence_Fast(item, "cannot convert an update element to a sequence");
            r = -1;
            if (fast != NULL) {
                if (PySequence_Fast_GET_SIZE(fast) == 2)
                    r = store(t, PySequence_Fast_GET_ITEM(fast, 0), PySequence_Fast_GET_ITEM(fast, 1));
                else
                    PyErr_Format(PyExc_ValueError, "update element has length %zd; 2 is required",
                                 PySequence_Fast_GET_SIZE(fast));
                Py_DECREF(fast);
            }
        }
        Py_DECREF(item);
        if (r < 0) {
            Py_DECREF(it);
            return -1;
        }
    }
    Py_DECREF(it);
    return PyErr_Occurred() ? -1 : 0;
}

/* dict.update's rule: a mapping (it has keys()) by its keys, else an iterable of pairs. */
static int update_from(NodeTable *t, PyObject *other)
{
    PyObject *keys, *it, *k;
    int has_keys;
    if (PyDict_CheckExact(other)) {
        Py_ssize_t pos = 0;
        PyObject *v;
        while (PyDict_Next(other, &pos, &k, &v)) {
            Py_INCREF(k);
            Py_INCREF(v);
            int r = store(t, k, v);
            Py_DECREF(k);
            Py_DECREF(v);
            if (r < 0)
                return -1;
        }
        return 0;
    }
    keys = PyObject_GetAttrString(other, "keys");
    has_keys = keys != NULL;
    if (!has_keys) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return -1;
        PyErr_Clear();
        return update_pairs(t, other);
    }
    it = PyObject_CallNoArgs(keys);
    Py_DECREF(keys);
    if (it == NULL)
        return -1;
    Py_SETREF(it, PyObject_GetIter(it));
    if (it == NULL)
        return -1;
    while ((k = PyIter_Next(it)) != NULL) {
        PyObject *v = PyObject_GetItem(other, k);
        int r = v == NULL ? -1 : store(t, k, v);
        Py_DECREF(k);
        Py_XDECREF(v);
        if (r < 0) {
            Py_DECREF(it);
            return -1;
        }
    }
    Py_DECREF(it);
    return PyErr_Occurred() ? -1 : 0;
}

static PyObject *NodeTable_update(NodeTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs > 1) {
        PyErr_Format(PyExc_TypeError, "update expected at most 1 argument, got %zd", nargs);
        return NULL;
    }
    if (nargs == 1 && update_from(t, args[0]) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* True when contains(self, x) is false for every item x of iterable other. */
static PyObject *isdisjoint_by(objobjproc contains, PyObject *self, PyObject *other)
{
    PyObject *it = PyObject_GetIter(other), *x;
    if (it == NULL)
        return NULL;
    while ((x = PyIter_Next(it)) != NULL) {
        int r = contains(self, x);
        Py_DECREF(x);
        if (r != 0) {
            Py_DECREF(it);
            if (r < 0)
                return NULL;
            Py_RETURN_FALSE;
        }
    }
    Py_DECREF(it);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_TRUE;
}

/* True when no item of iterable is a key (keys().isdisjoint, in one C pass). */
static PyObject *table_isdisjoint(NodeTable *t, PyObject *other)
{
    return isdisjoint_by((objobjproc)NodeTable_contains, (PyObject *)t, other);
}

static PyObject *NodeTable_sizeof(NodeTable *t, PyObject *unused)
{
    return PyLong_FromSize_t(sizeof(NodeTable) + (t->mask + 1) * sizeof(Slot));
}

static PyObject *NodeTable_repr(NodeTable *t)
{
    PyObject *d = PyDict_New(), *r;
    if (d == NULL)
        return NULL;
    if (PyDict_Merge(d, (PyObject *)t, 1) < 0) {
        Py_DECREF(d);
        return NULL;
    }
    r = PyUnicode_FromFormat("NodeTable(%R)", d);
    Py_DECREF(d);
    return r;
}

static PyObject *make_view(NodeTable *t, int kind);
static PyObject *make_iter(NodeTable *t, int kind);

static PyObject *NodeTable_keys(NodeTable *t, PyObject *u) { return make_view(t, 0); }
static PyObject *NodeTable_values(NodeTable *t, PyObject *u) { return make_view(t, 1); }
static PyObject *NodeTable_items(NodeTable *t, PyObject *u) { return make_view(t, 2); }
static PyObject *NodeTable_iter(NodeTable *t) { return make_iter(t, 0); }

static PyObject *NodeTable_reduce(NodeTable *t, PyObject *u)
{
    PyErr_SetString(PyExc_TypeError, "cannot pickle 'NodeTable' object");
    return NULL;
}

static PyMethodDef NodeTable_methods[] = {
    {"get", (PyCFunction)(void (*)(void))NodeTable_get, METH_FASTCALL,
     "get(key, default=None): table[key] if key is in the table, else default."},
    {"pop", (PyCFunction)(void (*)(void))NodeTable_pop, METH_FASTCALL,
     "pop(key[, default]): remove key and return its value (KeyError without default)."},
    {"update", (PyCFunction)(void (*)(void))NodeTable_update, METH_FASTCALL,
     "update(other): set the items of a mapping or of an iterable of pairs."},
    {"clear", (PyCFunction)NodeTable_clear, METH_NOARGS, "Remove every item."},
    {"keys", (PyCFunction)NodeTable_keys, METH_NOARGS, "A view of the keys."},
    {"values", (PyCFunction)NodeTable_values, METH_NOARGS, "A view of the values."},
    {"items", (PyCFunction)NodeTable_items, METH_NOARGS, "A view of the (key, value) pairs."},
    {"isdisjoint", (PyCFunction)table_isdisjoint, METH_O,
     "isdisjoint(iterable): True when none of its items is a key."},
    {"__sizeof__", (PyCFunction)NodeTable_sizeof, METH_NOARGS, "Bytes held by the table."},
    {"__reduce__", (PyCFunction)NodeTable_reduce, METH_NOARGS, "Not picklable."},
    {NULL, NULL, 0, NULL},
};

static PyMappingMethods NodeTable_as_mapping = {
    (lenfunc)NodeTable_length,
    (binaryfunc)NodeTable_subscript,
    (objobjargproc)NodeTable_ass_subscript,
};

static PySequenceMethods NodeTable_as_sequence = {
    .sq_contains = (objobjproc)NodeTable_contains,
};

static PyTypeObject NodeTable_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "connector.events._node_table.NodeTable",
    .tp_doc = "Block hash -> node, a dict for every key; ints in [0, 2**64) kept inline.",
    .tp_basicsize = sizeof(NodeTable),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_MAPPING,
    .tp_new = NodeTable_new,
    .tp_init = (initproc)NodeTable_init,
    .tp_dealloc = (destructor)NodeTable_dealloc,
    .tp_traverse = (traverseproc)NodeTable_traverse,
    .tp_clear = (inquiry)NodeTable_tp_clear,
    .tp_repr = (reprfunc)NodeTable_repr,
    .tp_as_mapping = &NodeTable_as_mapping,
    .tp_as_sequence = &NodeTable_as_sequence,
    .tp_iter = (getiterfunc)NodeTable_iter,
    .tp_methods = NodeTable_methods,
    .tp_hash = PyObject_HashNotImplemented,
};

/* -- views and iterators (kind: 0 keys, 1 values, 2 items) ------------------------------- */

typedef struct {
    PyObject_HEAD
    NodeTable *table;
    int kind;
    size_t pos;          /* next slot */
    Py_ssize_t fb_pos;   /* PyDict_Next's position in the fallback dict */
    uint64_t mutations;  /* the table's, when the iterator started */
    int done;
} Iter;

typedef struct {
    PyObject_HEAD
    NodeTable *table;
    int kind;
} View;

static PyObject *make_iter(NodeTable *t, int kind)
{
    Iter *it = PyObject_GC_New(Iter, &Iter_Type);
    if (it == NULL)
        return NULL;
    Py_INCREF(t);
    it->table = t;
    it->kind = kind;
    it->pos = 0;
    it->fb_pos = 0;
    it->mutations = t->mutations;
    it->done = 0;
    PyObject_GC_Track(it);
    return (PyObject *)it;
}

static PyObject *item_of(int kind, PyObject *k, PyObject *v)
{
    if (k == NULL || v == NULL) {
        Py_XDECREF(k);
        Py_XDECREF(v);
        return NULL;
    }
    if (kind == 0) {
        Py_DECREF(v);
        return k;
    }
    if (kind == 1) {
        Py_DECREF(k);
        return v;
    }
    PyObject *pair = PyTuple_Pack(2, k, v);
    Py_DECREF(k);
    Py_DECREF(v);
    return pair;
}

static PyObject *Iter_next(Iter *it)
{
    NodeTable *t = it->table;
    PyObject *k, *v;
    if (it->done)
        return NULL;
    if (t->mutations != it->mutations) {
        it->done = 1;
        PyErr_SetString(PyExc_RuntimeError, "NodeTable changed size during iteration");
        return NULL;
    }
    while (it->pos <= t->mask) {
        Slot *s = &t->slots[it->pos++];
        if (s->lo)
            return item_of(it->kind, key_decode(s->key), val_decode(s));
    }
    if (t->fallback != NULL && PyDict_Next(t->fallback, &it->fb_pos, &k, &v)) {
        Py_INCREF(k);
        Py_INCREF(v);
        return item_of(it->kind, k, v);
    }
    it->done = 1;
    return NULL;
}

static int Iter_traverse(Iter *it, visitproc visit, void *arg)
{
    Py_VISIT(it->table);
    return 0;
}

static void Iter_dealloc(Iter *it)
{
    PyObject_GC_UnTrack(it);
    Py_XDECREF(it->table);
    PyObject_GC_Del(it);
}

static PyTypeObject Iter_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "connector.events._node_table.NodeTableIterator",
    .tp_basicsize = sizeof(Iter),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_dealloc = (destructor)Iter_dealloc,
    .tp_traverse = (traverseproc)Iter_traverse,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)Iter_next,
};

static PyObject *make_view(NodeTable *t, int kind)
{
    View *v = PyObject_GC_New(View, &View_Type);
    if (v == NULL)
        return NULL;
    Py_INCREF(t);
    v->table = t;
    v->kind = kind;
    PyObject_GC_Track(v);
    return (PyObject *)v;
}

static Py_ssize_t View_length(View *v) { return NodeTable_length(v->table); }
static PyObject *View_iter(View *v) { return make_iter(v->table, v->kind); }

static int View_contains(View *v, PyObject *x)
{
    if (v->kind == 0)
        return NodeTable_contains(v->table, x);
    if (v->kind == 2) {
        if (!PyTuple_Check(x) || PyTuple_GET_SIZE(x) != 2)
            return 0;
        PyObject *got = lookup(v->table, PyTuple_GET_ITEM(x, 0));
        if (got == NULL)
            return PyErr_Occurred() ? -1 : 0;
        int r = PyObject_RichCompareBool(got, PyTuple_GET_ITEM(x, 1), Py_EQ);
        Py_DECREF(got);
        return r;
    }
    PyObject *it = make_iter(v->table, 1), *item;
    if (it == NULL)
        return -1;
    while ((item = PyIter_Next(it)) != NULL) {
        int r = PyObject_RichCompareBool(item, x, Py_EQ);
        Py_DECREF(item);
        if (r != 0) {
            Py_DECREF(it);
            return r;
        }
    }
    Py_DECREF(it);
    return PyErr_Occurred() ? -1 : 0;
}

static PyObject *View_isdisjoint(View *v, PyObject *other)
{
    return isdisjoint_by((objobjproc)View_contains, (PyObject *)v, other);
}

static PyObject *View_repr(View *v)
{
    static const char *names[] = {"keys", "values", "items"};
    PyObject *list = PySequence_List((PyObject *)v), *r;
    if (list == NULL)
        return NULL;
    r = PyUnicode_FromFormat("NodeTable_%s(%R)", names[v->kind], list);
    Py_DECREF(list);
    return r;
}

static int View_traverse(View *v, visitproc visit, void *arg)
{
    Py_VISIT(v->table);
    return 0;
}

static void View_dealloc(View *v)
{
    PyObject_GC_UnTrack(v);
    Py_XDECREF(v->table);
    PyObject_GC_Del(v);
}

static PyMethodDef View_methods[] = {
    {"isdisjoint", (PyCFunction)View_isdisjoint, METH_O,
     "isdisjoint(iterable): True when none of its items is in the view."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods View_as_sequence = {
    .sq_length = (lenfunc)View_length,
    .sq_contains = (objobjproc)View_contains,
};

static PyTypeObject View_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "connector.events._node_table.NodeTableView",
    .tp_basicsize = sizeof(View),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_dealloc = (destructor)View_dealloc,
    .tp_traverse = (traverseproc)View_traverse,
    .tp_repr = (reprfunc)View_repr,
    .tp_as_sequence = &View_as_sequence,
    .tp_iter = (getiterfunc)View_iter,
    .tp_methods = View_methods,
};

/* -- the walk: index.lane_groups in C ------------------------------------------------------ */

#define SHIFT 32
#define FACTS 0xFFFFFFFFULL
#define FULL_BITS 1 /* BlockKind.FULL: the kind bits of a FULL entry */
#define AHEAD 16    /* slots prefetched ahead of the walk */

#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(p) __builtin_prefetch(p)
#else
#define PREFETCH(p) ((void)0)
#endif

/* The node of key (0 when absent): 1 and *out for an int in [0, 2**127), 0 for any other
 * value, -1 on error. */
static int node_at(NodeTable *t, PyObject *key, int inline_key, uint64_t k, u128 *out)
{
    PyObject *v;
    *out = 0;
    if (inline_key) {
        Slot *s = find(t, k);
        if (s == NULL)
            return 1;
        if (IS_INLINE(s->lo)) {
            *out = INLINE_VALUE(s);
            return 1;
        }
        v = AS_OBJ(s->lo);
    } else {
        if (t->fallback == NULL)
            return check_hashable(key) < 0 ? -1 : 1;
        v = PyDict_GetItemWithError(t->fallback, key);
        if (v == NULL)
            return PyErr_Occurred() ? -1 : 1;
    }
    return PyLong_CheckExact(v) ? long_u127(v, out) : 0;
}

static int append_group(PyObject *groups, u128 lanes, Py_ssize_t run)
{
    PyObject *mask = u128_to_long(lanes), *pair;
    int r;
    if (mask == NULL)
        return -1;
    pair = Py_BuildValue("(Nn)", mask, run);
    r = pair == NULL ? -1 : PyList_Append(groups, pair);
    Py_XDECREF(pair);
    return r;
}

/* Read key j of ends for the walk into ring slot r, and prefetch its slot. */
static inline int ahead(NodeTable *t, PyObject **ends, Py_ssize_t j, uint64_t *keys, int *inl,
                        int r)
{
    inl[r] = key_u64(ends[j], &keys[r]);
    if (inl[r] > 0) {
        const Slot *s = &t->slots[(size_t)mix64(keys[r]) & t->mask];
        PREFETCH(s);
        PREFETCH((const char *)s + sizeof(Slot) - 1);
    }
    return inl[r];
}

/* Walk ends[0..n) (the chain's block ends), every lane at once; see lane_groups' doc. The
 * slots of the next AHEAD keys are prefetched while one is read (misses overlap).
 * 0 with *representable cleared: a node this walk cannot read (the caller walks in Python). */
static int walk(NodeTable *t, PyObject **ends, Py_ssize_t n, uint64_t step, PyObject *groups,
                int *representable)
{
    uint64_t keys[AHEAD];
    u128 alive = 0;
    int inl[AHEAD];
    Py_ssize_t j;
    for (j = 0; j < n && j < AHEAD; j++) {
        if (ahead(t, ends, j, keys, inl, (int)j) < 0)
            return -1;
    }
    for (j = 0; j < n; j++) {
        int ring = (int)(j % AHEAD), r;
        uint64_t k = keys[ring], f;
        int inline_key = inl[ring];
        u128 node, held;
        if (j + AHEAD < n && ahead(t, ends, j + AHEAD, keys, inl, ring) < 0)
            return -1;
        r = node_at(t, ends[j], inline_key, k, &node);
        if (r <= 0) {
            if (r == 0)
                *representable = 0;
            return r;
        }
        f = (uint64_t)node & FACTS;
        held = f == (uint64_t)(j + 1) * step + FULL_BITS || f == FULL_BITS ? node >> SHIFT : 0;
        if (j == 0) {
            alive = held;
        } else if (alive & ~held) {
            if (append_group(groups, alive & ~held, j) < 0)
                return -1;
            alive &= held;
        }
        if (!alive)
            return 0;
    }
    return n ? append_group(groups, alive, n) : 0;
}

static PyObject *mod_lane_groups(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *seq, *groups;
    unsigned long long b;
    int representable = 1;
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "lane_groups expected 3 arguments, got %zd", nargs);
        return NULL;
    }
    if (!PyObject_TypeCheck(args[0], &NodeTable_Type)) {
        PyErr_SetString(PyExc_TypeError, "lane_groups: the table must be a NodeTable");
        return NULL;
    }
    b = PyLong_AsUnsignedLongLong(args[2]);
    if (b == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if (b > (1ULL << 40)) {
        PyErr_SetString(PyExc_ValueError, "lane_groups: block size out of range");
        return NULL;
    }
    seq = PySequence_Fast(args[1], "lane_groups: ends must be a sequence");
    if (seq == NULL)
        return NULL;
    groups = PyList_New(0);
    if (groups != NULL && walk((NodeTable *)args[0], PySequence_Fast_ITEMS(seq),
                               PySequence_Fast_GET_SIZE(seq), b * 4, groups, &representable) < 0) {
        Py_CLEAR(groups);
    }
    Py_DECREF(seq);
    if (groups == NULL && representable)
        return NULL;
    if (groups == NULL || !representable) {
        Py_XDECREF(groups);
        Py_RETURN_NONE;
    }
    return groups;
}

static PyMethodDef module_methods[] = {
    {"lane_groups", (PyCFunction)(void (*)(void))mod_lane_groups, METH_FASTCALL,
     "lane_groups(table, ends, b): connector.events.index.lane_groups over the block ends\n"
     "``ends`` (one hash per block of ``b`` tokens): [(lanes, run), ...]; None when a node\n"
     "is not an int below 2**127 (walk it in Python)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "connector.events._node_table",
    .m_doc = "The index's node table in C: connector.events.node_table is its Python face.",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__node_table(void)
{
    PyObject *m;
    if (PyType_Ready(&NodeTable_Type) < 0 || PyType_Ready(&View_Type) < 0 ||
        PyType_Ready(&Iter_Type) < 0)
        return NULL;
    m = PyModule_Create(&module_def);
    if (m == NULL)
        return NULL;
    Py_INCREF(&NodeTable_Type);
    if (PyModule_AddObject(m, "NodeTable", (PyObject *)&NodeTable_Type) < 0 ||
        PyModule_AddIntConstant(m, "SHIFT", SHIFT) < 0 ||
        PyModule_AddIntConstant(m, "FULL_BITS", FULL_BITS) < 0) {
        Py_DECREF(&NodeTable_Type);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
