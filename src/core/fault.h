/* Fault points for stress tests: QTUNE_TEST_FAULT names a point in the code,
 * a rank and an occurrence, and what happens there. Unset (always, outside
 * tests) each point costs one comparison. */
#ifndef QT_FAULT_H
#define QT_FAULT_H

/* At the point `phase` on `rank`: when QTUNE_TEST_FAULT is
 * "PHASE@RANK#N:ACTION" and this is the N-th time (from 1) this rank passes
 * PHASE, do ACTION: "term" raises SIGTERM in this process (a stop request
 * arriving at exactly this moment), "sleepMS" sleeps MS milliseconds (widens
 * the window around it), "skip" makes it return 1 (the caller skips a check
 * there, to reach what the check guards against). Several specs are separated by commas. Every pass
 * also sleeps QTUNE_TEST_FAULT_DELAY_MS milliseconds when that is set, so that
 * an outside signal lands inside the phases. */
int qt_fault_point(const char *phase, int rank);

#endif
