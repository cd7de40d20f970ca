/* ThreadSanitizer and the descriptors libuv closes: one helper for every stream traind hands
 * to uv_close. Any thread; a no-op outside a ThreadSanitizer build.
 *
 * libuv closes a descriptor with the close system call itself (uv__close_nocancel), not libc's
 * close(), which is what TSan intercepts; so TSan still counts the descriptor open, with the
 * loop thread's last reads of it. A worker thread that later gets the same number from
 * opendir() and closes it is then reported as racing with those reads (test_work_lanes: a
 * sample's closedir in train/ckpt.c against libuv's read of the connection its client had just
 * hung up). td_tsan_fd_closing(fd), called just before uv_close, tells TSan through its own
 * hook for the close system call, so the number's later users start afresh; the descriptor is
 * still open then, so no other thread can hold that number yet. */
#ifndef TD_TSAN_H
#define TD_TSAN_H

#if defined(__SANITIZE_THREAD__)
#define TD_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define TD_TSAN 1
#endif
#endif

#ifdef TD_TSAN
void __sanitizer_syscall_pre_impl_close(long fd); /* the sanitizers' syscall hooks */

static inline void td_tsan_fd_closing(int fd)
{
    if (fd >= 0)
        __sanitizer_syscall_pre_impl_close(fd);
}
#else
static inline void td_tsan_fd_closing(int fd)
{
    (void)fd;
}
#endif

#endif
