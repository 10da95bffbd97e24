/* qtune doctor's rows for Ascend NPUs: the field report's failures on its
 * Atlas 300T A2 cards (driver status, the CANN version its RoPE operator
 * needs, HCCL timeouts, PCIe bandwidth) and the HCCL_* settings, each with
 * its fix. On a machine without npu-smi or CANN the rows say so and count no
 * warning. */
#ifndef QT_TRAIN_DOCTOR_NPU_H
#define QT_TRAIN_DOCTOR_NPU_H

#include <stdio.h>

/* Prints the rows; returns the number of warnings. npu-smi is looked up on
 * PATH; the CANN toolkit in $ASCEND_HOME_PATH, $ASCEND_TOOLKIT_HOME, else
 * /usr/local/Ascend/ascend-toolkit/latest; a card's PCIe link in
 * /sys/bus/pci/devices ($QTUNE_SYSFS_PCI replaces that folder, for tests). */
int qt_doctor_npu_report(FILE *f);

#endif
