/*
 * aenv-spawn: how the guest agent starts a user process. Built statically onto the tools drive
 * (images/toolsdrive.py), run by the agent as the first link of a vfork+exec chain:
 *
 *   aenv-spawn [--ns FILE] [--cwd DIR] [--user UID:GID[:G1,G2,...]] [--ctty] [--preopen] -- CMD [ARGS...]
 *
 * --ns    enter the mount namespace FILE (/proc/1/ns/mnt): the agent runs in a namespace of its
 *         own where the tools drive is mounted; user processes live in PID 1's, which has only
 *         the image (plus /proc, /dev, /sys, /tmp, /run)
 * --cwd   working directory, entered after the namespace switch (setns resets it to /)
 * --user  switch to UID, GID and the supplementary groups (as root)
 * --ctty  new session with stdin (a pty) as its controlling terminal
 * --preopen  open CMD before entering the namespace and exec it by descriptor: for a static
 *         program of the tools drive (busybox sh for images with no shell at all)
 *
 * Doing this in a tiny static program lets the agent start every command with posix_spawn (a
 * vfork+exec): a preexec_fn in the agent would make every command a full fork of the Python
 * process, several times slower under emulation. Descriptors other than 0-2 are closed at the
 * exec. Errors go to stderr with exit status 127, as a shell reports them.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>

#define MAX_GROUPS 256

extern char **environ;

static void die(const char *what, const char *arg) {
    fprintf(stderr, "aenv-spawn: %s%s%s: %s\n", what, arg ? " " : "", arg ? arg : "", strerror(errno));
    exit(127);
}

static void usage(void) {
    fprintf(stderr, "usage: aenv-spawn [--ns FILE] [--cwd DIR] [--user UID:GID[:G1,...]] [--ctty] -- CMD [ARGS...]\n");
    exit(127);
}

int main(int argc, char **argv) {
    const char *ns = NULL, *cwd = NULL, *user = NULL;
    int ctty = 0, preopen = 0, prefd = -1, i = 1;
    for (; i < argc; i++) {
        if (!strcmp(argv[i], "--")) { i++; break; }
        else if (!strcmp(argv[i], "--ns") && i + 1 < argc) ns = argv[++i];
        else if (!strcmp(argv[i], "--cwd") && i + 1 < argc) cwd = argv[++i];
        else if (!strcmp(argv[i], "--user") && i + 1 < argc) user = argv[++i];
        else if (!strcmp(argv[i], "--ctty")) ctty = 1;
        else if (!strcmp(argv[i], "--preopen")) preopen = 1;
        else usage();
    }
    if (i >= argc) usage();
    if (preopen && (prefd = open(argv[i], O_PATH | O_CLOEXEC)) < 0) die("cannot open", argv[i]);
    if (ns) {
        int fd = open(ns, O_RDONLY | O_CLOEXEC);
        if (fd < 0 || setns(fd, CLONE_NEWNS) < 0) die("cannot enter the mount namespace", ns);
        close(fd);
    }
    if (cwd && chdir(cwd) < 0) die("cannot enter the working directory", cwd);
    if (ctty) {
        if (setsid() < 0) die("setsid", NULL);
        if (ioctl(0, TIOCSCTTY, 0) < 0) die("cannot take the terminal", NULL);
    }
    if (user) {
        char *end;
        unsigned long uid = strtoul(user, &end, 10), gid;
        gid_t groups[MAX_GROUPS];
        int n = 0;
        if (*end != ':') usage();
        gid = strtoul(end + 1, &end, 10);
        if (*end == ':') {
            char *p = end + 1;
            while (*p && n < MAX_GROUPS) {
                groups[n++] = (gid_t)strtoul(p, &end, 10);
                if (*end != ',') break;
                p = end + 1;
            }
        }
        if (setgroups(n, groups) < 0) die("setgroups", NULL);
        if (setgid((gid_t)gid) < 0) die("setgid", NULL);
        if (setuid((uid_t)uid) < 0) die("setuid", NULL);
    }
    /* The agent spawns with posix_spawn, which closes only close-on-exec descriptors: mark
     * every other one (>= 3) so none leaks into the command. Best effort on old kernels. */
    close_range(3, ~0U, CLOSE_RANGE_CLOEXEC);
    if (prefd >= 0) {
        fexecve(prefd, argv + i, environ);
        die("cannot run", argv[i]);
    }
    execvp(argv[i], argv + i);
    die("cannot run", argv[i]);
    return 127;
}
