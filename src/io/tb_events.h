/* TensorBoard event files (report_to "tensorboard"): what the HF Trainer's
 * TensorBoardCallback writes through torch's SummaryWriter, scalars under the
 * Trainer's tag names (train/loss, train/learning_rate, eval/loss, ...).
 *
 * A file events.out.tfevents.TIME.HOST.PID.0 in the log folder is a sequence
 * of TFRecords, each
 *     uint64 length | uint32 masked_crc32c(length) | data | uint32 masked_crc32c(data)
 * (little-endian; masked_crc = ((crc >> 15) | (crc << 17)) + 0xa282ead8, crc
 * the CRC-32C of those bytes), whose data is one serialized Event message
 * (tb_event.proto, encoded by protobuf-c): first {wall_time, file_version
 * "brain.Event:2"}, then one {wall_time, step, summary {tag, simple_value}}
 * per scalar. Every record is flushed to the file as it is written, so
 * TensorBoard shows a live run. */
#ifndef QT_IO_TB_EVENTS_H
#define QT_IO_TB_EVENTS_H

#include <stddef.h>
#include <stdint.h>

typedef struct qt_tb_writer qt_tb_writer;

/* Creates the folder logdir (and its parents) and a new event file in it,
 * and writes the file_version event. */
int qt_tb_open(qt_tb_writer **w, const char *logdir);
/* One scalar event: tag at step, wall_time in seconds since the epoch. */
int qt_tb_scalar(qt_tb_writer *w, const char *tag, long step, double wall_time, float value);
/* The event file's path. */
const char *qt_tb_path(const qt_tb_writer *w);
void qt_tb_close(qt_tb_writer *w);

/* CRC-32C (Castagnoli, reflected 0x82f63b78) of n bytes, and TFRecord's mask of it. */
uint32_t qt_crc32c(const void *p, size_t n);
uint32_t qt_tb_masked_crc(const void *p, size_t n);

#endif
