/* What the runtime's C kernels share about the instruction set they are built for (-march=native): whether
 * bfloat16 dot products (AVX512-BF16) and AMX tiles are there, Linux's per-process grant of the tile state,
 * the tile configuration's layout, and float32 ↔ bfloat16 as torch rounds. Included by cpu_kernel.c,
 * skinny_linear.c and paged_decode.c. */
#ifndef VLM_ISA_H
#define VLM_ISA_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_BF16DOT 1
#else
#define HAVE_BF16DOT 0
#endif

#if HAVE_BF16DOT && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif

#if HAVE_AMX
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

static int amx_state; /* 1: the kernel granted this process the tile data state; -1: refused */
static pthread_once_t amx_once = PTHREAD_ONCE_INIT;

static __attribute__((unused)) void amx_request(void) {
    /* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: Linux enables the 8 KB tile state per process on request */
    amx_state = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
}
#endif

/* Whether this library may run AMX tiles here: built for them, and the tile state granted (asked once). */
static inline int amx_granted(void) {
#if HAVE_AMX
    pthread_once(&amx_once, amx_request);
    return amx_state == 1;
#else
    return 0;
#endif
}

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch's .to(bfloat16) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#endif /* VLM_ISA_H */
