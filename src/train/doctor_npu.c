/* qtune doctor's Ascend rows (doctor_npu.h): what the field report met on
 * its cards, read from the machine, each problem with its fix. Only reads:
 * `npu-smi info`, CANN's install record, the HCCL_* environment and the
 * PCIe link in sysfs.
 *
 * The HCCL_* meanings are CANN's environment-variable reference
 * (hiascend.com, CANN 8.0 "envvar" pages): HCCL_CONNECT_TIMEOUT, seconds the
 * ranks wait for each other while HCCL connects, [120, 7200], default 120
 * (HCCL adds 20 s to report why); HCCL_EXEC_TIMEOUT, seconds a card waits for
 * the others inside a collective, default 1836 on Atlas A2 (0: never);
 * HCCL_WHITELIST_DISABLE, 1 (default) no IP whitelist, 0 checked against
 * HCCL_WHITELIST_FILE ({"host_ip": [...]}); HCCL_P2P_DISABLE appears in
 * CANN's list of HCCL variables (CANN 6.3 PyTorch guide) without a meaning
 * qtune could find, and HCCL_P2P_LEVEL is NCCL's name, in none of CANN's
 * lists: both are shown as set, not judged. */
#include "train/doctor_npu.h"

#include <ctype.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "dist/dist.h"

#define MAX_CARDS 64

typedef struct {
    int id;
    char name[32], health[32], bus[32];
} npu_card;

/* the path of `prog` on PATH, or 0 */
static int on_path(const char *prog, char *out, size_t cap) {
    const char *path = getenv("PATH");
    if (!path) return 0;
    for (const char *p = path; *p;) {
        size_t n = strcspn(p, ":");
        snprintf(out, cap, "%.*s/%s", (int)n, p, prog);
        if (n && access(out, X_OK) == 0) return 1;
        p += n + (p[n] == ':');
    }
    return 0;
}

static void trim(char *s) {
    size_t n = strlen(s);
    while (n && isspace((unsigned char)s[n - 1])) s[--n] = 0;
    size_t i = 0;
    while (isspace((unsigned char)s[i])) i++;
    memmove(s, s + i, strlen(s + i) + 1);
}

/* The first two cells of a table row "| a | b | ..." (0 when it is not one). */
static int cells(const char *line, char *a, char *b, size_t cap) {
    if (line[0] != '|') return 0;
    const char *p = line + 1, *q = strchr(p, '|');
    if (!q) return 0;
    snprintf(a, cap, "%.*s", (int)(q - p), p);
    p = q + 1;
    q = strchr(p, '|');
    if (!q) return 0;
    snprintf(b, cap, "%.*s", (int)(q - p), p);
    trim(a), trim(b);
    return 1;
}

/* `npu-smi info`: the driver's version and each card's name, health and bus.
 * A card is two rows: "| NPU  Name | Health | ..." then "| Chip | Bus-Id | ...". */
static int parse_npu_smi(FILE *p, char *version, size_t vcap, npu_card *cards, int *n) {
    char line[1024], a[256], b[256];
    int seen_header = 0, pending = -1;
    *n = 0;
    while (fgets(line, sizeof line, p)) {
        const char *v = strstr(line, "Version:");
        if (strstr(line, "npu-smi") && v) {
            seen_header = 1;
            snprintf(version, vcap, "%s", v + 8);
            version[strcspn(version, "|")] = 0;
            trim(version);
            continue;
        }
        if (!cells(line, a, b, sizeof a) || !isdigit((unsigned char)a[0])) continue;
        int id = atoi(a);
        const char *name = a + strspn(a, "0123456789");
        while (isspace((unsigned char)*name)) name++;
        if (*name && *n < MAX_CARDS) { /* the card's row */
            npu_card *c = &cards[(*n)++];
            c->id = id;
            snprintf(c->name, sizeof c->name, "%.31s", name);
            snprintf(c->health, sizeof c->health, "%.31s", b);
            c->bus[0] = 0;
            pending = *n - 1;
        } else if (pending >= 0 && strchr(b, ':')) { /* its first chip's row: the bus id */
            snprintf(cards[pending].bus, sizeof cards[pending].bus, "%.31s", b);
            for (char *c = cards[pending].bus; *c; c++) *c = (char)tolower((unsigned char)*c);
            pending = -1;
        }
    }
    return seen_header;
}

static int read_line_file(const char *dir, const char *bus, const char *name, char *out, size_t cap) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s/%s", dir, bus, name);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    int ok = fgets(out, (int)cap, f) != NULL;
    fclose(f);
    if (ok) trim(out);
    return ok;
}

/* GB/s one way over `width` lanes at `gts` GT/s (8b/10b below 8 GT/s, 128b/130b from it) */
static double pcie_gbs(double gts, int width) { return gts * width * (gts >= 8 ? 128.0 / 130 : 0.8) / 8; }

/* The PCIe row of one card; 1 when its link runs below what it can. */
static int report_pcie(FILE *f, const npu_card *c) {
    const char *dir = getenv("QTUNE_SYSFS_PCI");
    if (!dir || !*dir) dir = "/sys/bus/pci/devices";
    char cs[64], cw[64], ms[64], mw[64];
    if (!c->bus[0] || !read_line_file(dir, c->bus, "current_link_speed", cs, sizeof cs) ||
        !read_line_file(dir, c->bus, "current_link_width", cw, sizeof cw) ||
        !read_line_file(dir, c->bus, "max_link_speed", ms, sizeof ms) ||
        !read_line_file(dir, c->bus, "max_link_width", mw, sizeof mw)) {
        fprintf(f, "           npu %d PCIe link: not readable (%s/%s)\n", c->id, dir, c->bus[0] ? c->bus : "?");
        return 0;
    }
    const double s = atof(cs), smax = atof(ms);
    const int w = atoi(cw), wmax = atoi(mw);
    fprintf(f, "           npu %d PCIe %s: x%d at %.1f GT/s, %.1f GB/s each way (the slot and card can do x%d at %.1f "
               "GT/s, %.1f GB/s)\n", c->id, c->bus, w, s, pcie_gbs(s, w), wmax, smax, pcie_gbs(smax, wmax));
    if (w >= wmax && s >= smax) return 0;
    fprintf(f, "  warning: npu %d's PCIe link runs at %.0f%% of its bandwidth: HCCL between cards crosses it, the "
               "field report's PCIe saturation comes sooner; seat the card in a full x%d slot and check the BIOS's "
               "PCIe generation setting (the link may also train down to save power when idle: read it under load)\n",
            c->id, 100 * pcie_gbs(s, w) / pcie_gbs(smax, wmax), wmax);
    return 1;
}

static int report_npu_smi(FILE *f, int *present) {
    char exe[4096];
    *present = on_path("npu-smi", exe, sizeof exe);
    if (!*present) {
        fprintf(f, "npu        npu-smi not found: no Ascend driver on this machine (needed only for \"device\": "
                   "\"npu\")\n");
        return 0;
    }
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "'%s' info 2>&1", exe);
    FILE *p = popen(cmd, "r");
    if (!p) {
        fprintf(f, "npu        could not run %s\n", exe);
        return 0;
    }
    npu_card cards[MAX_CARDS];
    char version[128] = "";
    int n = 0, header = parse_npu_smi(p, version, sizeof version, cards, &n), st = pclose(p);
    if (st != 0 || !header) {
        fprintf(f, "npu        `npu-smi info` failed (exit status %d)\n", WIFEXITED(st) ? WEXITSTATUS(st) : -1);
        fprintf(f, "  warning: the Ascend driver is not answering: check that it is installed and loaded "
                   "(/usr/local/Ascend/driver; `lsmod | grep drv`), run `npu-smi info` as root to see why, and "
                   "reinstall the driver matching the card's firmware if it still fails\n");
        return 1;
    }
    int warnings = 0;
    fprintf(f, "npu        driver %s (npu-smi info); %d card%s\n", version[0] ? version : "?", n, n == 1 ? "" : "s");
    for (int i = 0; i < n; i++) {
        const npu_card *c = &cards[i];
        fprintf(f, "           npu %d  %s  health %s\n", c->id, c->name, c->health);
        if (strcmp(c->health, "OK")) {
            fprintf(f, "  warning: npu %d reports health %s: a run on it may fail at any step; read `npu-smi info -t "
                       "health -i %d` for the alarm, and reset the card (`npu-smi set -t reset -i %d`, as root) or "
                       "leave it out of the job\n", c->id, c->health, c->id, c->id);
            warnings++;
        }
        warnings += report_pcie(f, c);
    }
    return warnings;
}

/* CANN's version from the toolkit's install record ("version=8.1.RC1") */
static int cann_version(char *dir, size_t dcap, char *ver, size_t vcap) {
    const char *roots[] = {getenv("ASCEND_HOME_PATH"), getenv("ASCEND_TOOLKIT_HOME"),
                           "/usr/local/Ascend/ascend-toolkit/latest"};
    const char *arch[] = {"x86_64-linux", "aarch64-linux"};
    for (size_t r = 0; r < sizeof roots / sizeof roots[0]; r++) {
        if (!roots[r] || !*roots[r]) continue;
        for (size_t a = 0; a < 2; a++) {
            char path[4096], line[256];
            snprintf(path, sizeof path, "%s/%s/ascend_toolkit_install.info", roots[r], arch[a]);
            FILE *fp = fopen(path, "r");
            if (!fp) continue;
            ver[0] = 0;
            while (fgets(line, sizeof line, fp))
                if (!strncmp(line, "version=", 8)) {
                    snprintf(ver, vcap, "%.100s", line + 8);
                    trim(ver);
                }
            fclose(fp);
            snprintf(dir, dcap, "%s", roots[r]);
            return 1;
        }
    }
    return 0;
}

static int report_cann(FILE *f, int *present) {
    char dir[4096], ver[128];
    *present = cann_version(dir, sizeof dir, ver, sizeof ver);
    if (!*present) {
        fprintf(f, "cann       no CANN toolkit found (ASCEND_HOME_PATH unset, no /usr/local/Ascend/ascend-toolkit): "
                   "needed only for \"npu\"\n");
        return 0;
    }
    int major = 0, minor = 0;
    sscanf(ver, "%d.%d", &major, &minor);
    fprintf(f, "cann       %s (%s)\n", ver[0] ? ver : "version unknown", dir);
    if (major > 8 || (major == 8 && minor >= 1)) return 0;
    fprintf(f, "  warning: CANN %s is older than 8.1.RC1, whose operators qtune's Ascend backend calls (its RoPE "
               "among them: the field report's \"RoPE operator not supported\" came from an older CANN); install "
               "CANN 8.1.RC1 or later and source its set_env.sh\n", ver[0] ? ver : "(unknown)");
    return 1;
}

/* an HCCL_* number: its value, or def when unset; -1 when set but not a number */
static double env_seconds(const char *name, double def, const char **raw) {
    const char *v = getenv(name);
    *raw = v;
    if (!v || !*v) return def;
    char *end = NULL;
    double x = strtod(v, &end);
    return end != v && !*end && x >= 0 ? x : -1;
}

static int report_hccl(FILE *f) {
    int warnings = 0;
    const char *rc, *re;
    const double conn = env_seconds("HCCL_CONNECT_TIMEOUT", 120, &rc), exec = env_seconds("HCCL_EXEC_TIMEOUT", 1836, &re);
    const char *qv = getenv("QTUNE_DIST_TIMEOUT");
    const double q = qv && atof(qv) > 0 ? atof(qv) : DIST_DEFAULT_TIMEOUT_S;
    fprintf(f, "hccl       HCCL_CONNECT_TIMEOUT %s s%s, HCCL_EXEC_TIMEOUT %s s%s; qtune's collective deadline %.0f s "
               "(QTUNE_DIST_TIMEOUT)\n", rc ? rc : "120", rc ? "" : " (unset: HCCL's default)", re ? re : "1836",
            re ? "" : " (unset: HCCL's default on Atlas A2)", q);
    if (conn < 0 || (rc && (conn < 120 || conn > 7200))) {
        fprintf(f, "  warning: HCCL_CONNECT_TIMEOUT='%s' is outside HCCL's range of 120 to 7200 seconds; set a whole "
                   "number in it (raise it when ranks reach the start of training far apart, e.g. while loading "
                   "a large model)\n", rc);
        warnings++;
    }
    if (exec < 0) {
        fprintf(f, "  warning: HCCL_EXEC_TIMEOUT='%s' is not a number of seconds; set e.g. 1836 (HCCL's default)\n", re);
        warnings++;
    } else if (exec > 0 && exec < q) {
        fprintf(f, "  warning: HCCL_EXEC_TIMEOUT (%.0f s) ends a stalled collective before qtune's deadline (%.0f s), "
                   "so HCCL's error comes instead of qtune's naming the stalled rank (the report's HCCL timeouts); "
                   "set HCCL_EXEC_TIMEOUT above QTUNE_DIST_TIMEOUT\n", exec, q);
        warnings++;
    }
    const char *wd = getenv("HCCL_WHITELIST_DISABLE"), *wf = getenv("HCCL_WHITELIST_FILE");
    if (wd && !strcmp(wd, "0")) {
        struct stat st;
        if (!wf || !*wf || stat(wf, &st) != 0) {
            fprintf(f, "  warning: HCCL_WHITELIST_DISABLE=0 turns HCCL's IP whitelist on, but HCCL_WHITELIST_FILE %s: "
                       "HCCL refuses every peer; point it at a file {\"host_ip\": [\"IP\", ...]} listing every host, "
                       "or set HCCL_WHITELIST_DISABLE=1\n", wf && *wf ? "names no file" : "is unset");
            warnings++;
        } else {
            fprintf(f, "           IP whitelist on (HCCL_WHITELIST_DISABLE=0): %s; every host's address must be in it\n", wf);
        }
    } else {
        fprintf(f, "           IP whitelist off (HCCL_WHITELIST_DISABLE %s)\n", wd ? wd : "unset: 1, HCCL's default");
    }
    const char *pd = getenv("HCCL_P2P_DISABLE"), *pl = getenv("HCCL_P2P_LEVEL");
    if (pd || pl)
        fprintf(f, "           HCCL_P2P_DISABLE %s, HCCL_P2P_LEVEL %s (shown as set; HCCL_P2P_LEVEL is NCCL's name and "
                   "not among CANN's documented variables)\n", pd ? pd : "unset", pl ? pl : "unset");
    return warnings;
}

int qt_doctor_npu_report(FILE *f) {
    int smi, cann;
    int w = report_npu_smi(f, &smi);
    w += report_cann(f, &cann);
    const char *vars[] = {"HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT", "HCCL_WHITELIST_DISABLE", "HCCL_WHITELIST_FILE",
                          "HCCL_P2P_DISABLE", "HCCL_P2P_LEVEL"};
    int set = 0;
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) set += getenv(vars[i]) != NULL;
    if (smi || cann || set) w += report_hccl(f);
    else fprintf(f, "hccl       no HCCL_* settings; HCCL is not used on this machine (no Ascend driver or CANN)\n");
    return w;
}
