/* A headless Chromium driven over the Chrome DevTools Protocol, for tests that check a web
 * page in a real browser (test_dashboard.c). Chromium (Debian's `chromium`, or $TD_CHROMIUM)
 * runs with --remote-debugging-pipe: commands go to its fd 3 and replies come from its fd 4,
 * one JSON message each, ended by a NUL byte, so no port and no websocket library is needed.
 * JSON is jansson's.
 *
 * Every function fails the current test through cmocka when the browser does not answer or
 * answers with an error, so include <cmocka.h> first. Called from the test's one thread. */
#ifndef TS_CDP_H
#define TS_CDP_H

#include <stddef.h>

#include <jansson.h>

typedef struct cdp cdp;

/* Whether Chromium can run here at all: its binary is executable and a headless start that
 * prints a blank page's DOM exits 0. Returns 1, or 0 with the reason (the path, or the last
 * line Chromium wrote to stderr) in why: the only case in which a browser test may skip.
 * Chromium that starts and then hangs past CDP_PROBE_MS fails the test instead. */
int cdp_usable(char *why, size_t size);

/* Starts Chromium with a fresh profile in a temporary directory, a width x height viewport and
 * one page, and attaches to it. Its stderr goes to log (appended). Caller stops it with
 * cdp_stop(). */
cdp *cdp_start(int width, int height, const char *log);

/* Closes the browser, waits for it (kills its process group after 10 s) and removes the
 * profile. Accepts NULL. */
void cdp_stop(cdp *b);

/* Sends method with params (taken; NULL for none) to the page and returns the reply's result
 * (caller decrefs). */
json_t *cdp_call(cdp *b, const char *method, json_t *params);

/* Loads url in the page (returns once the navigation has been committed, not loaded). */
void cdp_navigate(cdp *b, const char *url);

/* Evaluates a JavaScript expression in the page (awaiting it when it is a promise) and returns
 * its value (caller decrefs; JSON null for undefined). A thrown exception fails the test. */
json_t *cdp_eval(cdp *b, const char *expr);

/* cdp_eval() of expr as an integer (a number or a boolean), or as a string into buf. */
long long cdp_eval_int(cdp *b, const char *expr);
void cdp_eval_str(cdp *b, const char *expr, char *buf, size_t size);

/* Evaluates expr every 50 ms until it is truthy (an exception counts as not yet); returns the
 * milliseconds it took, or fails the test after timeout_ms with what (a description of what was
 * awaited). */
long long cdp_wait(cdp *b, const char *expr, int timeout_ms, const char *what);

/* A PNG screenshot of the viewport: its bytes (caller frees) and length. */
unsigned char *cdp_screenshot(cdp *b, size_t *len);

/* Exceptions the page threw (Runtime.exceptionThrown) since cdp_start, and the first one's
 * text into buf (may be NULL). */
int cdp_exceptions(cdp *b, char *buf, size_t size);

#endif
