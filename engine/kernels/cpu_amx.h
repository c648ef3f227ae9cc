/* AMX tiles (Sapphire Rapids and later): the permission Linux wants asked first, and the one
 * tile shape the kernels use. Linux hands a process the tiles' state only once it asks
 * (arch_prctl); each thread loads the tile configuration before its first tile and releases
 * it after its last. Included where __AMX_TILE__ and __AMX_BF16__ are defined. */
#ifndef PDCLUSTER_CPU_AMX_H
#define PDCLUSTER_CPU_AMX_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
enum { TR = 16 }; /* rows of a tile */

/* Whether this process may use the tiles (asked once; the answer does not change). */
static inline int amx_permitted(void) {
    static int permitted = -1;
    if (permitted < 0)
        permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return permitted;
}

/* Palette 1, all eight tiles 16 rows of 64 bytes: every tile of the kernels has that shape. */
static inline void configure_tiles(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) config.colsb[t] = 64, config.rows[t] = TR;
    _tile_loadconfig(&config);
}

static inline void release_tiles(void) { _tile_release(); }
#endif
