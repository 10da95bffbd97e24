/* Fault points (fault.h). */
#include "core/fault.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { FAULT_MAX = 16 };

typedef struct {
    char phase[48];
    int rank;
    long at;   /* the occurrence, from 1 */
    long seen; /* passes so far */
    int term;  /* 1: raise SIGTERM; 2: skip; 0: sleep ms */
    long ms;
} fault_spec;

static fault_spec specs[FAULT_MAX];
static int n_specs = -1; /* -1: not read yet */
static long delay_ms;

static void sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0) {}
}

static void read_specs(void) {
    n_specs = 0;
    const char *d = getenv("QTUNE_TEST_FAULT_DELAY_MS");
    delay_ms = d ? atol(d) : 0;
    const char *e = getenv("QTUNE_TEST_FAULT");
    if (!e) return;
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", e);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok && n_specs < FAULT_MAX;
         tok = strtok_r(NULL, ",", &save)) {
        fault_spec s = {.rank = 0, .at = 1};
        char action[32] = "";
        if (sscanf(tok, "%47[^@]@%d#%ld:%31s", s.phase, &s.rank, &s.at, action) != 4) {
            fprintf(stderr, "qtune: warning: QTUNE_TEST_FAULT entry \"%s\" is not PHASE@RANK#N:ACTION; ignored\n", tok);
            continue;
        }
        if (!strcmp(action, "term")) s.term = 1;
        else if (!strcmp(action, "skip")) s.term = 2;
        else if (!strncmp(action, "sleep", 5)) s.ms = atol(action + 5);
        else {
            fprintf(stderr, "qtune: warning: QTUNE_TEST_FAULT action \"%s\" is not term, skip or sleepMS; ignored\n", action);
            continue;
        }
        specs[n_specs++] = s;
    }
}

int qt_fault_point(const char *phase, int rank) {
    if (n_specs < 0) read_specs();
    if (!n_specs && !delay_ms) return 0;
    if (delay_ms) sleep_ms(delay_ms);
    int skip = 0;
    for (int i = 0; i < n_specs; i++) {
        fault_spec *s = &specs[i];
        if (s->rank != rank || strcmp(s->phase, phase) || ++s->seen != s->at) continue;
        if (s->term == 1) raise(SIGTERM);
        else if (s->term == 2) skip = 1;
        else sleep_ms(s->ms);
    }
    return skip;
}
