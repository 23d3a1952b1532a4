/* CRC32C of bundle parts: see crc32c.c. */
#ifndef MLX_FLASH_CRC32C_H
#define MLX_FLASH_CRC32C_H
#include <stddef.h>
#include <stdint.h>

/* continue `crc` (0 to start) over n bytes */
uint32_t crc32c_update(uint32_t crc, const void *buf, size_t n);
/* set >= 0: use the hardware instruction (1) or the table (0) when available;
 * -1: keep the current choice. Returns the path in use (1 hardware, 0 table). */
int crc32c_hardware(int set);
#endif
