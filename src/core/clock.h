/* Wall time for measuring intervals (CLOCK_MONOTONIC: never jumps with the
 * system clock). */
#ifndef QT_CORE_CLOCK_H
#define QT_CORE_CLOCK_H

/* Seconds since an arbitrary fixed point; only differences mean anything. */
double qt_now_s(void);

#endif
