/* The label that carries no loss: a target equal to QT_IGNORE_INDEX adds
 * nothing to the loss and gets no gradient (HF's ignore_index). The data
 * writes it (data/, text/chat.c) and every backend's lm_head + cross-entropy
 * skips it (backend.h), so it lives below both. */
#ifndef QT_CORE_LABEL_H
#define QT_CORE_LABEL_H

#define QT_IGNORE_INDEX (-100)

#endif
