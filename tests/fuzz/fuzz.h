/* What every libFuzzer target of tests/fuzz/ shares: libFuzzer's entry points (declared here so
 * that -Wmissing-prototypes holds), a check that aborts with the failed condition (libFuzzer
 * saves the input that made it fail), a reader that takes little-endian numbers off the front
 * of an input, and a private scratch directory for the targets whose readers take paths.
 * Single-threaded, as libFuzzer calls a target. */
#ifndef TD_FUZZ_H
#define TD_FUZZ_H

#include <stddef.h>
#include <stdint.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

/* A property of the code under test that the input broke: prints it and aborts. */
#define TDF_CHECK(cond)                          \
    do {                                         \
        if (!(cond))                             \
            tdf_fail(__FILE__, __LINE__, #cond); \
    } while (0)

_Noreturn void tdf_fail(const char *file, int line, const char *what);

/* The bytes of an input not yet taken. A number taken past the end reads as 0. */
typedef struct tdf_in {
    const uint8_t *p;
    size_t n;
} tdf_in;

uint8_t tdf_u8(tdf_in *in);
uint16_t tdf_u16(tdf_in *in);
uint32_t tdf_u32(tdf_in *in);
/* Up to want bytes off the front: *len says how many. */
const uint8_t *tdf_bytes(tdf_in *in, size_t want, size_t *len);

/* The process's scratch directory: made on first use (mkdtemp) under $TD_FUZZ_TMP, else
 * /dev/shm, else /tmp; emptied and removed at exit. Nothing a target writes goes elsewhere. */
const char *tdf_dir(void);

/* path = tdf_dir()/name; aborts when it does not fit. */
void tdf_path(char *path, size_t size, const char *name);

/* Writes n bytes as the whole of file tdf_dir()/name (created 0600, truncated); its path goes
 * to path (size bytes). Aborts on an I/O error: the scratch directory is the harness's own. */
void tdf_write(char *path, size_t size, const char *name, const void *p, size_t n);

#endif
