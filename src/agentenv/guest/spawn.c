/*
 * libaenvspawn: how the guest agent starts a user process. Built as a shared library onto the
 * tools drive (images/toolsdrive.py) and called by the agent through ctypes (agentlib/spawn.py):
 *
 *   pid_t aenv_spawn(const struct aenv_spawn_req *req)   -> child pid, or -errno
 *
 * One vfork-style clone whose child, with no Python and no allocation in between:
 *   - resets every signal to its default disposition (the agent ignores SIGPIPE; a command
 *     must not inherit that) and starts a session of its own (setsid);
 *   - makes the request's descriptors its stdin, stdout and stderr; with `ctty`, stdin (a pty)
 *     becomes its controlling terminal;
 *   - opens a tools-drive program (`preopen`, the fallback busybox shell) while it can still
 *     see the tools drive, then enters PID 1's mount namespace (`ns_fd`): the agent runs in a
 *     namespace of its own where the tools drive is mounted, user processes in PID 1's, which
 *     has only the image (plus /proc, /dev, /sys, /tmp, /run);
 *   - enters the working directory (after the namespace switch: setns resets it to /), takes
 *     the user's groups, gid and uid;
 *   - marks every other descriptor close-on-exec and execs the command, searching the
 *     command's own PATH (not the agent's).
 *
 * Why a library and not a helper program: the agent used to posix_spawn a small static
 * program that did the same and then exec'd the command. Under emulation (TCG) every exec
 * costs milliseconds, and that second exec was a fixed part of every command's round trip.
 * Why not Python's preexec_fn: it makes every command a full fork of the agent.
 *
 * The child shares the agent's memory until it execs (CLONE_VM | CLONE_VFORK), so it calls
 * only raw system calls: glibc's setuid/setgid/setgroups would broadcast the change to the
 * agent's other threads. A failure before the exec (no such program, a working directory
 * that cannot be entered) is left in the request for the agent, as Go's os/exec reports it
 * to envd: the start fails, instead of a process that exits with 127.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#ifndef CLOSE_RANGE_CLOEXEC
#define CLOSE_RANGE_CLOEXEC (1U << 2)
#endif

/* Keep in step with agentlib/spawn.py (_Request). */
struct aenv_spawn_req {
    const char *file;          /* the command: a path, or a name looked up in `path` */
    char *const *argv;         /* NULL-terminated */
    char *const *envp;         /* NULL-terminated */
    const char *path;          /* the command's PATH, for a name without '/' */
    const char *cwd;           /* NULL: stay in / (or the agent's cwd without ns_fd) */
    int ns_fd;                 /* mount namespace to enter, or -1 */
    int fds[3];                /* become 0, 1, 2 */
    int ctty;                  /* stdin is a pty: make it the controlling terminal */
    int preopen;               /* open `file` before entering the namespace, exec it by fd */
    int switch_user;           /* take uid, gid and groups */
    unsigned int uid, gid;
    int ngroups;
    const unsigned int *groups;
    /* Set by the child when it fails before its exec (the parent reads them once the
     * vfork-style clone returns: the child ran in the parent's memory). */
    int err;                   /* errno */
    const char *what;          /* the step that failed (a static string) */
};

/* The child's stack: what it needs, plus the argument vector of a script run through
 * /bin/sh (exec_file copies it onto the stack). */
#define STACK_SIZE (256 * 1024)

static void die(struct aenv_spawn_req *r, const char *what, int err) {
    r->what = what;
    r->err = err ? err : EINVAL;
    syscall(SYS_exit_group, 127);
    for (;;) {}
}

/* execve, and a file that is not an executable format run through /bin/sh, as execvp does;
 * returns only on failure. */
static void exec_file(struct aenv_spawn_req *r, const char *path) {
    syscall(SYS_execve, path, r->argv, r->envp);
    if (errno != ENOEXEC) return;
    int argc = 0;
    while (r->argv[argc]) argc++;
    char *sh_argv[argc + 2];
    sh_argv[0] = (char *)"/bin/sh";
    sh_argv[1] = (char *)path;
    for (int i = 1; i <= argc; i++) sh_argv[i + 1] = r->argv[i];
    syscall(SYS_execve, "/bin/sh", sh_argv, r->envp);
    die(r, "cannot run", ENOEXEC);
}

/* execvp with the command's PATH: try each directory. */
static void exec_search(struct aenv_spawn_req *r) {
    size_t flen = strlen(r->file);
    int saw_eacces = 0;
    const char *p = r->path && *r->path ? r->path : "/usr/local/bin:/usr/bin:/bin";
    char buf[PATH_MAX];
    while (1) {
        const char *end = strchrnul(p, ':');
        size_t dlen = (size_t)(end - p);
        if (dlen + 1 + flen + 1 <= sizeof buf) {
            if (dlen) { memcpy(buf, p, dlen); buf[dlen++] = '/'; }
            memcpy(buf + dlen, r->file, flen + 1);
            exec_file(r, buf);
            if (errno == EACCES) saw_eacces = 1;
            else if (errno != ENOENT && errno != ENOTDIR && errno != ESTALE && errno != ENODEV && errno != ETIMEDOUT)
                die(r, "cannot run", errno);
        }
        if (!*end) break;
        p = end + 1;
    }
    die(r, "cannot run", saw_eacces ? EACCES : ENOENT);
}

static int child(void *arg) {
    struct aenv_spawn_req *r = arg;
    struct { void *handler; unsigned long flags; void *restorer; unsigned long mask; } dfl = {0}; /* the kernel's layout; SIG_DFL is 0 */
    for (int s = 1; s < NSIG; s++)
        syscall(SYS_rt_sigaction, s, &dfl, NULL, sizeof(unsigned long)); /* EINVAL for KILL/STOP: fine */
    if (syscall(SYS_setsid) < 0) die(r, "setsid", errno);
    for (int i = 0; i < 3; i++) {
        if (r->fds[i] == i) {
            int fl = (int)syscall(SYS_fcntl, i, F_GETFD);
            if (fl >= 0) syscall(SYS_fcntl, i, F_SETFD, fl & ~FD_CLOEXEC);
        } else if (syscall(SYS_dup2, r->fds[i], i) < 0) {
            die(r, "cannot set up the standard descriptors", errno);
        }
    }
    int prefd = -1;
    if (r->preopen && (prefd = (int)syscall(SYS_open, r->file, O_PATH | O_CLOEXEC)) < 0)
        die(r, "cannot open", errno);
    if (r->ns_fd >= 0 && syscall(SYS_setns, r->ns_fd, CLONE_NEWNS) < 0)
        die(r, "cannot enter the mount namespace of PID 1", errno);
    if (r->cwd && syscall(SYS_chdir, r->cwd) < 0) die(r, "cannot enter the working directory", errno);
    if (r->ctty && syscall(SYS_ioctl, 0, TIOCSCTTY, 0) < 0) die(r, "cannot take the terminal", errno);
    if (r->switch_user) {
        if (syscall(SYS_setgroups, r->ngroups, r->groups) < 0) die(r, "setgroups", errno);
        if (syscall(SYS_setgid, r->gid) < 0) die(r, "setgid", errno);
        if (syscall(SYS_setuid, r->uid) < 0) die(r, "setuid", errno);
    }
    syscall(SYS_close_range, 3U, ~0U, CLOSE_RANGE_CLOEXEC); /* best effort on old kernels */
    unsigned long none = 0;
    syscall(SYS_rt_sigprocmask, SIG_SETMASK, &none, NULL, sizeof none);
    if (prefd >= 0) {
        syscall(SYS_execveat, prefd, "", r->argv, r->envp, AT_EMPTY_PATH);
        die(r, "cannot run", errno);
    }
    if (strchr(r->file, '/')) {
        exec_file(r, r->file);
        die(r, "cannot run", errno);
    }
    exec_search(r);
    return 127;
}

/* The child's pid, or -errno. A child that failed before its exec has exited (the agent's
 * SIGCHLD handler reaps it); the return is then -errno too, with req->what set. */
pid_t aenv_spawn(struct aenv_spawn_req *req) {
    size_t argc = 0;
    while (req->argv[argc]) argc++;
    size_t size = (STACK_SIZE + (argc + 2) * sizeof(char *) + 15) & ~(size_t)15;
    req->err = 0;
    req->what = NULL;
    /* All signals blocked across the clone: a handler of the agent must never run on the
     * child's stack with the agent's memory. The child unblocks them right before its exec. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    char *stack = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
    pid_t pid;
    int err = 0;
    if (stack == MAP_FAILED) {
        pid = -1;
        err = errno;
    } else {
        pid = clone(child, stack + size, CLONE_VM | CLONE_VFORK | SIGCHLD, (void *)req);
        err = errno;
        munmap(stack, size);
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (pid > 0 && req->err) return -req->err;
    return pid < 0 ? -err : pid;
}
