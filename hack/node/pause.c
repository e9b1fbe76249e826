/* The sandbox ("pause") container of the test node's pods: holds the pod's namespaces, reaps
 * orphaned children, exits on SIGINT/SIGTERM. Built static by hack/images/build.sh into the
 * image localhost/ppojob-pause:<key> (the usual one lives on a registry this machine cannot
 * reach). */
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

static void quit(int sig) {
  (void)sig;
  _exit(0);
}

static void reap(int sig) {
  (void)sig;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

int main(void) {
  struct sigaction q = {.sa_handler = quit};
  struct sigaction r = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP};
  sigaction(SIGINT, &q, NULL);
  sigaction(SIGTERM, &q, NULL);
  sigaction(SIGCHLD, &r, NULL);
  for (;;) {
    pause();
  }
}
