/* See bf16_tiles.h. */
#include "bf16_tiles.h"

#ifdef PD_AMX
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

void pd_tiles_on(void) {
    tilecfg_t cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = TILE;
    /* GCC 12 does not count ldtilecfg as reading its operand and drops the stores above: the
     * address escapes here, so they happen */
    __asm__ volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}
#else
void pd_tiles_on(void) {}
#endif

int pd_amx_ready(void) {
#ifdef PD_AMX
    static int ready = -1;
    if (ready < 0) ready = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return ready;
#else
    return 0;
#endif
}
