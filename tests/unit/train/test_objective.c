/* The job's "objective" (train/objective.h): TRL's names and defaults, keys
 * that do not belong refused by name, and the per-pair math against values
 * worked out by hand (the PyTorch parity is tests/ref/test_ref_pref.py). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "core/error.h"
#include "train/job.h"

static int parse(const char *obj, qt_job *j) {
    char json[1024];
    snprintf(json, sizeof json, "{\"model\": \"m\", \"output_dir\": \"o\", \"data\": {\"train\": \"t.jsonl\"}%s%s}",
             obj ? ", \"objective\": " : "", obj ? obj : "");
    return qt_job_parse(json, ".", "job.json", NULL, 0, j);
}

static void test_defaults(void **state) {
    (void)state;
    qt_job j;
    assert_int_equal(parse(NULL, &j), QT_OK);
    assert_int_equal(j.objective.type, QT_OBJ_SFT);
    qt_job_free(&j);
    assert_int_equal(parse("{\"type\": \"dpo\"}", &j), QT_OK);
    assert_int_equal(j.objective.type, QT_OBJ_DPO);
    assert_int_equal(j.objective.loss_type, QT_DPO_SIGMOID);
    assert_true(j.objective.beta == 0.1);
    assert_true(qt_objective_needs_ref(&j.objective));
    qt_job_free(&j);
    assert_int_equal(parse("{\"type\": \"dpo\", \"loss_type\": \"ipo\", \"beta\": 0.5, \"reference_free\": true}", &j),
                     QT_OK);
    assert_int_equal(j.objective.loss_type, QT_DPO_IPO);
    assert_false(qt_objective_needs_ref(&j.objective));
    assert_true(qt_objective_averages(&j.objective));
    qt_job_free(&j);
    assert_int_equal(parse("{\"type\": \"simpo\", \"gamma\": 1.5}", &j), QT_OK);
    assert_true(j.objective.simpo_gamma == 1.5 && j.objective.cpo_alpha == 0);
    qt_job_free(&j);
    assert_int_equal(parse("{\"type\": \"simpo\"}", &j), QT_OK);
    assert_true(j.objective.simpo_gamma == 0.5); /* CPOConfig's default */
    qt_job_free(&j);
    /* precompute_ref_log_probs: unset means on for full fine-tuning (no frozen copy), off for LoRA */
    assert_int_equal(parse("{\"type\": \"dpo\"}", &j), QT_OK);
    assert_true(qt_objective_precomputes_ref(&j.objective, 0));
    assert_false(qt_objective_precomputes_ref(&j.objective, 1));
    qt_job_free(&j);
    assert_int_equal(parse("{\"type\": \"dpo\", \"precompute_ref_log_probs\": true}", &j), QT_OK);
    assert_true(qt_objective_precomputes_ref(&j.objective, 1));
    qt_job_free(&j);
    assert_int_equal(parse("{\"type\": \"dpo\", \"precompute_ref_log_probs\": true, \"reference_free\": true}", &j),
                     QT_OK);
    assert_false(qt_objective_precomputes_ref(&j.objective, 0)); /* no reference, nothing to precompute */
    qt_job_free(&j);
}

static void refused(const char *obj, const char *words) {
    qt_job j;
    assert_int_not_equal(parse(obj, &j), QT_OK);
    if (!strstr(qt_error_message(), words)) fail_msg("%s: '%s' lacks '%s'", obj, qt_error_message(), words);
}

static void test_refusals(void **state) {
    (void)state;
    refused("{\"type\": \"kto\"}", "objective.type must be \"sft\", \"dpo\", \"orpo\" or \"simpo\" (not \"kto\")");
    refused("{\"type\": \"dpo\", \"betta\": 0.2}", "objective.betta is not a key of the objective; did you mean 'beta'?");
    refused("{\"type\": \"orpo\", \"loss_type\": \"ipo\"}", "objective.loss_type does not apply to type \"orpo\"");
    refused("{\"type\": \"simpo\", \"gamma_beta_ratio\": 0.5}", "write simpo_gamma = gamma_beta_ratio * beta");
    refused("{\"type\": \"dpo\", \"loss_type\": \"kto_pair\"}", "objective.loss_type must be \"sigmoid\"");
    refused("{\"type\": \"dpo\", \"beta\": 0}", "objective.beta must be above 0");
    refused("{\"type\": \"dpo\", \"label_smoothing\": 0.5}", "objective.label_smoothing must be in [0, 0.5)");
    refused("{\"type\": \"dpo\", \"loss_type\": \"hinge\", \"label_smoothing\": 0.1}", "applies to loss_type");
    refused("{\"type\": \"dpo\", \"reference_free\": 1}", "objective.reference_free must be true or false");
    refused("\"dpo\"", "\"objective\" must be an object");
    refused("{\"type\": \"dpo\", \"precompute_ref_log_probs\": 1}", "precompute_ref_log_probs must be true or false");
    refused("{\"type\": \"orpo\", \"precompute_ref_log_probs\": true}", "does not apply to type \"orpo\"");
}

static void test_dpo_sigmoid_by_hand(void **state) {
    (void)state;
    qt_objective o;
    qt_objective_default(&o);
    o.type = QT_OBJ_DPO;
    /* one pair: z = (-10 - -14) - (-11 - -12) = 3, u = beta z = 0.3 */
    double pc = -10, pr = -14, rc = -11, rr = -12, wc, wr;
    int64_t nc = 4, nr = 6;
    qt_pref_sums s = {0};
    qt_objective_pairs(&o, 1, &pc, &pr, &rc, &rr, &nc, &nr, 1.0, 0.25, &wc, &wr, &s);
    double u = 0.3, sig = 1 / (1 + exp(-u));
    assert_true(fabs(s.loss - log1p(exp(-u))) < 1e-12);
    assert_true(fabs(wc - -0.1 * (1 - sig)) < 1e-12 && fabs(wr - 0.1 * (1 - sig)) < 1e-12);
    assert_true(fabs(s.rewards_chosen - 0.1) < 1e-12 && fabs(s.rewards_rejected - -0.2) < 1e-12);
    assert_true(s.accuracies == 1 && fabs(s.margins - 0.3) < 1e-12);
    assert_true(s.logps_chosen == -10 && s.logps_rejected == -14 && s.pairs == 1);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_defaults),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_dpo_sigmoid_by_hand),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
