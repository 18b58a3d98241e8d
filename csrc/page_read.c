/* The file store's page read in one call (radixlm/runtime/mem_cache/storage/native_read.py
 * builds this with `cc -O2 -shared -fPIC` and calls it through ctypes, which releases the GIL for
 * the whole call).
 *
 * Why C: in Python a page read is ~8 calls that each give the GIL up and take it back (open,
 * the header's read, the payload's read(2)s, their CRCs, the byte past the end, close). Beside
 * a scheduler thread that runs Python while it launches a forward, every take-back waits up to
 * the switch interval, so a restart's store read ran at a fraction of the page cache's rate.
 * Here the whole page is one take-back. The checks themselves stay in Python (file_backend.py):
 * this only moves bytes and computes the CRC.
 *
 * The CRC-32 is the caller's function (zlib-ng's zng_crc32 or zlib's crc32, found in the
 * already-loaded libraries: both have zlib's polynomial and this signature up to the width of
 * the integers, which the mask below and the x86-64 / AArch64 calling conventions make agree).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <unistd.h>

typedef unsigned long (*crc32_fn)(unsigned long crc, const unsigned char *buf, unsigned int len);

/* read(2) until `len` bytes or the end of the file: bytes read, or -errno */
static int64_t read_full(int fd, uint8_t *dst, int64_t len, int64_t chunk, crc32_fn crc,
                         uint32_t *crc_io) {
    int64_t got = 0;
    while (got < len) {
        int64_t want = len - got < chunk ? len - got : chunk;
        ssize_t n = read(fd, dst + got, (size_t)want);
        if (n < 0) {
            if (errno == EINTR) continue;
            return -(int64_t)errno;
        }
        if (n == 0) break;
        if (crc) /* each piece CRC'd right after its read, while it is in the core's cache */
            *crc_io = (uint32_t)(crc(*crc_io, dst + got, (unsigned int)n) & 0xffffffffUL);
        got += n;
    }
    return got;
}

/* Reads the file at `path`: its first `header_len` bytes into `header` (*header_got: how many
 * there were), then, only if the header is whole, up to `dst_len` bytes of payload into `dst`
 * in `chunk`-byte read(2)s, each CRC'd by `crc` into *crc_out; then asks for one byte more.
 * Returns the payload's length (dst_len + 1 when the file is longer than header + dst_len), or
 * -errno when open or a read fails (-ENOENT: no such file). */
int64_t radixlm_read_page(const char *path, uint8_t *header, int64_t header_len,
                          int64_t *header_got, uint8_t *dst, int64_t dst_len, int64_t chunk,
                          crc32_fn crc, uint32_t *crc_out) {
    *header_got = 0;
    *crc_out = 0;
    if (chunk <= 0) return -EINVAL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -(int64_t)errno;
    (void)posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL); /* a cold file: read ahead */
    int64_t got = read_full(fd, header, header_len, header_len, 0, 0);
    if (got >= 0) {
        *header_got = got;
        if (got < header_len) {
            got = 0; /* a short header: no payload read */
        } else {
            got = read_full(fd, dst, dst_len, chunk, crc, crc_out);
            if (got == dst_len) { /* the one byte more that tells a longer file */
                uint8_t extra;
                int64_t more = read_full(fd, &extra, 1, 1, 0, 0);
                got = more < 0 ? more : got + more;
            }
        }
    }
    close(fd);
    return got;
}
