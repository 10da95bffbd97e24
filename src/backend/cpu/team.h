/* A team of OpenMP threads held for a run of small ops: a decode step.
 *
 * A one-token step of the 0.5B model makes about 145 parallel calls (the
 * products and the attention of 24 layers, the lm_head), each a few tens of
 * microseconds, and opening a parallel region costs about 3 us (fork and
 * join, 2 threads, libgomp); a job handed to threads that already wait in a
 * region costs about 0.8 us. So the decode step runs inside one region:
 * the calling thread runs the step and the others spin until it hands them a
 * job (op_team_run) or the step ends.
 *
 * Only the ops given the team use its threads. Any other op's own OpenMP
 * region inside the step runs on the calling thread alone (a nested region),
 * so a caller holds the team only for steps whose other ops are serial
 * anyway (the model's decode with few rows). */
#ifndef QT_BACKEND_CPU_TEAM_H
#define QT_BACKEND_CPU_TEAM_H

typedef struct op_team op_team;
/* one thread's part of a job: thread tid of nth (the caller is tid 0) */
typedef void (*op_team_job)(void *arg, int tid, int nth);

/* Runs fn(team, arg) on the calling thread, the team's other threads waiting
 * for its jobs until fn returns, and returns fn's result. team is NULL (fn
 * runs as a plain call) where no team is worth holding: one thread, a
 * parallel region already open, more threads than CPUs (a thread that spins
 * would take the CPU from one that works), or the environment asks idle
 * threads not to spin (OMP_WAIT_POLICY=passive, GOMP_SPINCOUNT=0). */
int op_team_hold(int (*fn)(op_team *team, void *arg), void *arg);

/* job on every thread of the team, returning when all have finished it. With
 * team NULL, on the threads of a parallel region of its own. */
void op_team_run(op_team *team, op_team_job job, void *arg);

/* threads op_team_run would use: the team's, else omp_get_max_threads() */
int op_team_size(const op_team *team);

#endif
