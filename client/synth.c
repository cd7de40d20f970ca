/* trainctl sensor synth: synthetic wearable data, written as sensor shards (train/sensor.h).
 *
 * Each sample is one person's day, midnight to midnight, one row a minute (T = 1440) of ten
 * channels. A person has a resting and a maximal heart rate, a fitness, a chronotype, a job at a
 * desk or not, a favourite time and favourite kinds of workout; each day draws a label (the
 * day's workout, or none) from the person's habits and builds a schedule around it: the end of
 * last night's sleep, work at a desk with a lunch break and walks to and from it on weekdays,
 * errands, the workout, tonight's sleep, and perhaps an hour with the watch on its charger. The
 * channels are then simulated minute by minute from the schedule: heart rate approaches an
 * effort-dependent target with a time constant (fast up, slower down, slower still for the
 * unfit), steps come only on foot, skin temperature rises in sleep and drops in water,
 * electrodermal activity rises with sweat and with moments of stress at the desk, and so on;
 * sensor noise, lost minutes and the charger's hour are NaN. Captions describe the day in
 * SensorLM's three levels, most informative first (README.md, "Sensor data").
 *
 * Deterministic: its own PRNG (splitmix64), streams derived from (seed, split, person), and
 * only double arithmetic and libm; the same trainctl build writes the same bytes for a seed.
 * Single-threaded, called from main's thread. */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "client/client.h"
#include "train/sensor.h"

#define DAY          1440 /* minutes: T */
#define NCH          10   /* channels */
#define DAYS_EACH    14   /* days generated per person: two weeks */
#define WALK_SHORT   18   /* minutes: the longest walk that is not a workout (errands, commute) */
#define PERIOD_S     60   /* seconds a row */
#define SPLIT_STREAM 0x73706c6974000000ull /* "split" << 24, plus the split */

/* ---- the PRNG ------------------------------------------------------------------------------ */

/* splitmix64 (Steele, Lea and Flood), whose output passes BigCrush; one 64-bit state. */
typedef struct rng {
    uint64_t s;
} rng;

static uint64_t rng_next(rng *r)
{
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);

    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* In [0, 1), 53 random bits. */
static double unif(rng *r)
{
    return (double)(rng_next(r) >> 11) * 0x1p-53;
}

static double range(rng *r, double a, double b)
{
    return a + (b - a) * unif(r);
}

/* In [a, b]. */
static int irange(rng *r, int a, int b)
{
    return a + (int)(unif(r) * (double)(b - a + 1));
}

static int chance(rng *r, double p)
{
    return unif(r) < p;
}

/* A standard normal, Box-Muller (one of the pair). */
static double gauss(rng *r)
{
    double u = 1.0 - unif(r), v = unif(r);

    return sqrt(-2.0 * log(u)) * cos(2.0 * M_PI * v);
}

static int clampi(int x, int lo, int hi)
{
    return x < lo ? lo : x > hi ? hi : x;
}

static double clampd(double x, double lo, double hi)
{
    return x < lo ? lo : x > hi ? hi : x;
}

/* x rounded to 1/q, as a device reports it (q = 10: one decimal); never -0. */
static float quant(double x, double q)
{
    return (float)(round(x * q) / q + 0.0);
}

/* ---- what the generator knows -------------------------------------------------------------- */

enum { CH_HR, CH_STEPS, CH_SKIN, CH_EDA, CH_SLEEP, CH_ACCEL, CH_ALT, CH_SPO2, CH_RESP, CH_HRV };

static const struct {
    const char *name, *unit;
} channels[NCH] = {
    {"heart_rate", "bpm"},          {"steps", "steps/min"},
    {"skin_temp", "degC"},          {"eda", "uS"},
    {"sleep_state", "stage"},       {"accel_mag", "g"},
    {"altitude_change", "m/min"},   {"spo2", "%"},
    {"respiration", "breaths/min"}, {"hrv_rmssd", "ms"},
};

/* What a person does in a minute. */
enum { A_SLEEP, A_REST, A_DESK, A_WALK, A_RUN, A_CYCLE, A_STRENGTH, A_SWIM, A_HIKE };

/* The day labels: the day's workout. min and max bound its minutes. A caption starts with the
 * label's prompt; the label table holds prompts (its "|"-separated list, each embedded and their
 * mean taken by zero-shot classification) worded as the captions begin, the second with the
 * workout's typical length (the middle of min and max, to 5 minutes). */
enum { L_REST, L_WALK, L_RUN, L_CYCLE, L_STRENGTH, L_SWIM, L_HIKE, NLABELS };

static const struct {
    const char *name, *prompt, *noun, *prompts;
    int act, min, max;
} labels[NLABELS] = {
    {"rest", "rest day", NULL, "rest day|rest day: no workout", A_REST, 0, 0},
    {"walk", "walking day", "walk", "walking day|walking day: an 80-minute walk", A_WALK, 45, 120},
    {"run", "running day", "run", "running day|running day: a 50-minute run", A_RUN, 25, 75},
    {"cycle", "cycling day", "bike ride", "cycling day|cycling day: a 95-minute bike ride", A_CYCLE,
     40, 150},
    {"strength", "strength training day", "strength session",
     "strength training day|strength training day: a 55-minute strength session", A_STRENGTH, 35,
     75},
    {"swim", "swimming day", "swim", "swimming day|swimming day: a 40-minute swim", A_SWIM, 25, 60},
    {"hike", "hiking day", "hike", "hiking day|hiking day: a 195-minute hike", A_HIKE, 120, 270},
};

typedef struct person {
    double rest_hr, max_hr; /* bpm */
    double fitness;         /* 0 (unfit) to 1 */
    double tau_rec;         /* minutes: heart rate's recovery time constant */
    double wake;            /* minute of the day it wakes on a weekday, on average */
    double sleep_need;      /* minutes a night */
    double skin_base;       /* degC: the wrist's skin temperature awake and at rest */
    double eda_base;        /* uS: tonic skin conductance at rest */
    double hrv_base;        /* ms: RMSSD at rest */
    double stress;          /* per desk minute: the chance of a stress response */
    double charge_p;        /* per day: the chance the watch spends an hour on its charger */
    int works;              /* a desk job on weekdays */
    int commutes;           /* walks to and from work */
    int slot;               /* workout time: 0 morning, 1 midday (evening on workdays), 2 evening */
    int weekday0;           /* weekday of its first day, 0 Monday */
    double weight[NLABELS]; /* how often each kind of day comes */
} person;

/* A day's schedule and what the captions say about it. */
typedef struct day {
    unsigned char act[DAY];   /* A_* */
    unsigned char stage[DAY]; /* sleep stage: 0 awake, 1 light, 2 deep, 3 REM */
    unsigned char off[DAY];   /* 1: the watch is on its charger: no readings */
    int label, weekday;
    int wake;                 /* the first minute awake */
    int bed;                  /* when tonight's sleep starts; DAY or more: after midnight */
    int bed_prev;             /* when last night's started (negative: before midnight) */
    int main_start, main_dur; /* the workout; main_dur 0 on a rest day */
    int desk_start, desk_end; /* desk_end 0: no desk work */
    int walk_start[8], walk_dur[8], n_walks; /* short walks */
    int off_start, off_dur;                  /* off_dur 0: never on the charger */
    double intensity;           /* the workout's effort, a fraction of the heart-rate reserve */
    double terrain, wavelength; /* cycle: m/min of the hills and minutes between them */
    int swim_lap;               /* swim: minutes between pauses at the wall */
} day;

/* ---- people and schedules ------------------------------------------------------------------ */

static void make_person(person *p, rng *r)
{
    double age = range(r, 20, 65);
    int fav1 = irange(r, 0, NLABELS - 1), fav2 = irange(r, 0, NLABELS - 2);

    p->fitness = unif(r);
    p->max_hr = 208 - 0.7 * age;
    p->rest_hr = clampd(72 - 18 * p->fitness + 3 * gauss(r), 45, 85);
    p->tau_rec = 1.5 + 2.5 * (1 - p->fitness);
    p->wake = range(r, 330, 510);
    p->sleep_need = range(r, 400, 510);
    p->skin_base = range(r, 32.3, 33.6);
    p->eda_base = exp(0.4 + 0.5 * gauss(r));
    p->hrv_base = range(r, 25, 75) * (0.7 + 0.6 * p->fitness);
    p->stress = range(r, 0.005, 0.04);
    p->charge_p = range(r, 0.1, 0.4);
    p->works = chance(r, 0.75);
    p->commutes = chance(r, 0.4);
    p->slot = irange(r, 0, 2);
    p->weekday0 = irange(r, 0, 6);
    /* Two favourite kinds of day, weighted 2.5 against 1: every person has habits, and over
     * many people the labels are balanced, since the favourites are drawn uniformly. */
    fav2 += fav2 >= fav1;
    for (int l = 0; l < NLABELS; l++)
        p->weight[l] = l == fav1 || l == fav2 ? 2.5 : 1.0;
}

static int draw_label(const person *p, rng *r)
{
    double total = 0, x;
    int l;

    for (l = 0; l < NLABELS; l++)
        total += p->weight[l];
    x = unif(r) * total;
    for (l = 0; l < NLABELS - 1 && x >= p->weight[l]; l++)
        x -= p->weight[l];
    return l;
}

static void paint(day *d, int act, int start, int len)
{
    for (int t = clampi(start, 0, DAY); t < clampi(start + len, 0, DAY); t++)
        d->act[t] = (unsigned char)act;
}

/* Nonzero when [start - 1, start + len] is all rest, within the day: room for something new
 * with a minute of rest either side. */
static int free_rest(const day *d, int start, int len)
{
    if (start < 1 || start + len + 1 > DAY)
        return 0;
    for (int t = start - 1; t <= start + len; t++)
        if (d->act[t] != A_REST)
            return 0;
    return 1;
}

static void add_walk(day *d, int start, int len)
{
    if (d->n_walks >= 8 || !free_rest(d, start, len))
        return;
    paint(d, A_WALK, start, len);
    d->walk_start[d->n_walks] = start;
    d->walk_dur[d->n_walks] = len;
    d->n_walks++;
}

/* Sleep stages for a night that starts at minute start (negative: the evening before) and
 * ends at end, for the minutes of it within the day: 90-minute cycles of light, deep, light
 * and REM sleep, deep sleep early in the night and REM late, and a few brief awakenings. */
static void sleep_stages(day *d, int start, int end, rng *r)
{
    int t = start + irange(r, 5, 20), k = 0; /* falling asleep: awake, then light */

    for (int m = start; m < t; m++)
        if (m >= 0 && m < DAY)
            d->stage[m] = 0;
    while (t < end) {
        int len = irange(r, 80, 105);
        double deep = fmax(0.05, 0.35 - 0.08 * k), rem = fmin(0.40, 0.10 + 0.07 * k);
        int l1 = (int)(len * (1 - deep - rem) / 2), dp = (int)(len * deep), l2 = l1;
        for (int i = 0; i < len && t + i < end; i++) {
            int m = t + i, s = i < l1 ? 1 : i < l1 + dp ? 2 : i < l1 + dp + l2 ? 1 : 3;
            if (m >= 0 && m < DAY)
                d->stage[m] = (unsigned char)s;
        }
        t += len;
        k++;
    }
    for (int m = clampi(start, 0, DAY); m < clampi(end, 0, DAY); m++)
        if (d->stage[m] != 0 && chance(r, 0.006)) {
            int n = irange(r, 1, 4);
            for (int i = 0; i < n && m + i < end && m + i < DAY; i++)
                d->stage[m + i] = 0;
        }
}

/* When the workout of dur minutes starts. On a workday it goes before work (for a morning
 * person, when it fits) or after; when neither fits before midnight, the person works from
 * home and *workday is cleared. May move bedtime later. */
static int workout_start(day *d, const person *p, int *workday, int dur, rng *r)
{
    int s = -1, morning = d->wake + irange(r, 15, 35);

    if (d->label == L_HIKE) {
        s = d->wake + irange(r, 45, 150);
    } else if (*workday) {
        int fits_morning = morning + dur + 15 <= d->desk_start - WALK_SHORT;
        int evening = d->desk_end + WALK_SHORT + irange(r, 15, 70);
        if (fits_morning && (p->slot == 0 || evening + dur > DAY - 15))
            s = morning;
        else if (evening + dur <= DAY - 15)
            s = evening;
        else
            *workday = 0;
    }
    if (s < 0) {
        s = p->slot == 0   ? d->wake + irange(r, 30, 120)
            : p->slot == 1 ? irange(r, 690, 900)
                           : irange(r, 1000, 1110);
        s = s < d->wake + 20 ? d->wake + 20 : s;
    }
    if (s + dur + 20 > d->bed)
        d->bed = s + dur + irange(r, 20, 45);
    return s;
}

static void plan_day(day *d, const person *p, int index, rng *r)
{
    int weekend, workday, sleep_prev, dur = 0, i;

    memset(d, 0, sizeof(*d));
    d->weekday = (p->weekday0 + index) % 7;
    weekend = d->weekday >= 5;
    d->label = draw_label(p, r);
    workday = p->works && !weekend && d->label != L_HIKE;
    d->wake =
        clampi((int)lround(p->wake + 20 * gauss(r) + (weekend ? range(r, 20, 80) : 0)), 300, 630);
    sleep_prev = (int)lround(p->sleep_need + 25 * gauss(r));
    d->bed_prev = d->wake - sleep_prev;
    d->bed = clampi((int)lround(d->wake + DAY - p->sleep_need + 25 * gauss(r) + 30 * weekend), 1230,
                    DAY + 60);
    if (workday) {
        d->desk_start = d->wake + irange(r, 50, 110);
        d->desk_end = d->desk_start + irange(r, 450, 540);
    }
    if (d->label != L_REST) {
        dur = irange(r, labels[d->label].min, labels[d->label].max);
        d->main_start = workout_start(d, p, &workday, dur, r);
        if (!workday)
            d->desk_start = d->desk_end = 0;
        d->main_dur = dur;
    }
    /* Paint: awake at rest, the nights, the desk and its lunch break, the commute, the workout. */
    for (int t = 0; t < DAY; t++)
        d->act[t] = (t >= d->bed_prev && t < d->wake) || t >= d->bed ? A_SLEEP : A_REST;
    if (workday) {
        int lunch = (d->desk_start + d->desk_end) / 2 - 20 + irange(r, -20, 20);
        int lunch_len = irange(r, 30, 50);
        paint(d, A_DESK, d->desk_start, d->desk_end - d->desk_start);
        paint(d, A_REST, lunch, lunch_len);
        if (chance(r, 0.4))
            add_walk(d, lunch + 5, irange(r, 8, 15));
        if (p->commutes) {
            int a = irange(r, 8, WALK_SHORT), b = irange(r, 8, WALK_SHORT);
            add_walk(d, d->desk_start - a - 1, a);
            add_walk(d, d->desk_end + 1, b);
        }
    }
    if (dur > 0)
        paint(d, labels[d->label].act, d->main_start, dur);
    for (i = 0; i < 2; i++) /* errands */
        if (chance(r, 0.5))
            for (int tries = 0; tries < 5; tries++) {
                int len = irange(r, 5, 15), s = irange(r, d->wake + 30, d->bed - 60);
                if (free_rest(d, s, len)) {
                    add_walk(d, s, len);
                    break;
                }
            }
    /* The charger: an unbroken stretch of rest, the first that fits from a random minute. */
    if (chance(r, p->charge_p)) {
        int len = irange(r, 30, 90), from = irange(r, d->wake, d->bed);
        for (int k = 0; k < DAY && d->off_dur == 0; k++) {
            int s = d->wake + (from - d->wake + k) % (d->bed - d->wake > 0 ? d->bed - d->wake : 1);
            if (s + len < d->bed && free_rest(d, s, len)) {
                d->off_start = s;
                d->off_dur = len;
                memset(d->off + s, 1, (size_t)len);
            }
        }
    }
    sleep_stages(d, d->bed_prev, d->wake, r);
    if (d->bed < DAY)
        sleep_stages(d, d->bed, d->bed + (int)p->sleep_need + 60, r);
    /* The workout's own character. */
    d->intensity = d->label == L_WALK       ? range(r, 0.26, 0.34)
                   : d->label == L_RUN      ? range(r, 0.68, 0.85)
                   : d->label == L_CYCLE    ? range(r, 0.52, 0.66)
                   : d->label == L_STRENGTH ? range(r, 0.45, 0.55)
                   : d->label == L_SWIM     ? range(r, 0.58, 0.70)
                   : d->label == L_HIKE     ? range(r, 4, 9) /* m/min climbed */
                                            : 0;
    d->terrain = range(r, 2, 7);
    d->wavelength = range(r, 12, 25);
    d->swim_lap = irange(r, 4, 7);
    /* The short walks in time order, for the captions. */
    for (i = 1; i < d->n_walks; i++)
        for (int j = i; j > 0 && d->walk_start[j] < d->walk_start[j - 1]; j--) {
            int s = d->walk_start[j], l = d->walk_dur[j];
            d->walk_start[j] = d->walk_start[j - 1];
            d->walk_dur[j] = d->walk_dur[j - 1];
            d->walk_start[j - 1] = s;
            d->walk_dur[j - 1] = l;
        }
}

/* ---- physiology ---------------------------------------------------------------------------- */

/* What a minute's activity asks of the body: the targets the slow channels approach, and the
 * readings of the fast ones. */
typedef struct want {
    double effort; /* fraction of the heart-rate reserve; < 0: hr is set directly */
    double hr;     /* bpm, when effort < 0 */
    double resp;   /* breaths/min */
    double skin;   /* degC */
    double eda;    /* uS, tonic */
    double accel;  /* g */
    double alt;    /* m/min */
    double steps;  /* steps/min */
    int water;     /* in a pool */
} want;

/* Targets for minute t, the since-th minute of its activity. */
static void targets(const day *d, const person *p, int t, int since, rng *r, want *w)
{
    int a = d->act[t], main = t >= d->main_start && t < d->main_start + d->main_dur;
    int left = d->main_start + d->main_dur - t;
    static const double sleep_hr[4] = {7, 0, -3, 3}, sleep_resp[4] = {14.5, 13.2, 12.5, 15.5};
    double grade;

    memset(w, 0, sizeof(*w));
    w->effort = -1;
    w->skin = p->skin_base;
    w->eda = p->eda_base;
    w->alt = 0.15 * gauss(r);
    switch (a) {
    case A_SLEEP:
        w->hr = p->rest_hr - 6 + sleep_hr[d->stage[t]];
        w->resp = sleep_resp[d->stage[t]];
        w->skin = p->skin_base + (d->stage[t] == 0 ? 0.9 : 1.3);
        w->eda = p->eda_base * 0.55;
        w->accel =
            0.004 + 0.003 * fabs(gauss(r)) + (d->stage[t] == 0 || chance(r, 0.04) ? 0.03 : 0);
        w->alt = 0.1 * gauss(r);
        break;
    case A_REST:
    case A_DESK:
        w->hr = p->rest_hr + (a == A_DESK ? 10 : 8);
        w->resp = a == A_DESK ? 15.5 : 15;
        w->accel = (a == A_DESK ? 0.018 : 0.025) + 0.012 * fabs(gauss(r));
        if (chance(r, a == A_DESK ? 0.04 : 0.12)) { /* up and about for a moment */
            w->steps = irange(r, 4, a == A_DESK ? 30 : 40);
            w->accel += 0.05;
        }
        if (a == A_DESK && chance(r, 0.01)) /* a flight of stairs */
            w->alt = (chance(r, 0.5) ? 1 : -1) * range(r, 3, 4);
        break;
    case A_WALK:
        w->effort = (main ? d->intensity : 0.28) + 0.02 * gauss(r);
        w->steps = 108 + 5 * gauss(r);
        w->accel = 0.22 + 0.03 * gauss(r);
        w->alt = 0.6 * gauss(r);
        w->skin = p->skin_base - 0.2;
        break;
    case A_RUN: /* a 5-minute warm-up, then the pace, then a 3-minute cool-down */
        w->effort = since < 5   ? 0.45 + (d->intensity - 0.45) * since / 5.0
                    : left <= 3 ? 0.5
                                : d->intensity;
        w->effort += 0.02 * gauss(r);
        w->steps = (since < 5 || left <= 3 ? 150 : 165) + 4 * gauss(r);
        w->accel = 0.62 + 0.05 * gauss(r);
        w->alt = 1.0 * gauss(r);
        w->skin = p->skin_base - 0.7;
        break;
    case A_CYCLE: /* rolling hills; the wrist moves with the pedalling in a steady rhythm */
        grade = d->terrain * sin(2 * M_PI * since / d->wavelength) + 0.5 * gauss(r);
        w->effort = d->intensity + 0.02 * grade + 0.02 * gauss(r);
        w->accel = 0.12 + 0.04 * fabs(sin(2 * M_PI * since / 3.5)) + 0.02 * fabs(gauss(r));
        w->alt = grade;
        w->skin = p->skin_base - 0.6;
        break;
    case A_STRENGTH: /* sets of two minutes, two minutes' rest between them */
        if (since % 4 < 2) {
            w->effort = d->intensity + 0.03 * gauss(r);
            w->accel = 0.35 + 0.05 * gauss(r);
        } else {
            w->effort = 0.25 + 0.02 * gauss(r);
            w->accel = 0.06 + 0.02 * fabs(gauss(r));
            w->steps = chance(r, 0.3) ? irange(r, 3, 12) : 0;
        }
        w->skin = p->skin_base - 0.3;
        break;
    case A_SWIM: /* lengths, and a minute at the wall every few minutes */
        if (since % d->swim_lap == d->swim_lap - 1) {
            w->effort = 0.40;
            w->accel = 0.12 + 0.02 * fabs(gauss(r));
        } else {
            w->effort = d->intensity + 0.02 * gauss(r);
            w->accel = 0.55 + 0.06 * gauss(r);
        }
        w->skin = 28.5;
        w->eda = p->eda_base * 3.5;
        w->alt = 0.05 * gauss(r);
        w->water = 1;
        break;
    case A_HIKE: /* up for the first half, down for the second */
        grade = (since < d->main_dur / 2 ? d->intensity : -1.1 * d->intensity) + 1.2 * gauss(r);
        w->effort = 0.36 + 0.025 * fmax(grade, 0) + 0.02 * gauss(r);
        w->steps = 95 - 1.5 * fmax(grade, 0) + 7 * gauss(r);
        w->accel = 0.26 + 0.04 * gauss(r);
        w->alt = grade;
        w->skin = p->skin_base - 0.4;
        break;
    }
    if (w->effort >= 0) {
        w->resp = 15 + 30 * w->effort;
        w->eda = w->water ? w->eda : p->eda_base * (1 + 2 * w->effort);
    }
}

/* The slow state carried from minute to minute. */
typedef struct body {
    double hr, skin, resp, eda, phasic;
    int gap; /* minutes left of a heart-rate dropout (a loose strap) */
} body;

/* One minute's readings into row[NCH] from the body after it moved towards w. */
static void read_minute(const day *d, const person *p, int t, const want *w, body *b, rng *r,
                        float *row)
{
    double hr_t = w->effort >= 0 ? p->rest_hr + w->effort * (p->max_hr - p->rest_hr) : w->hr;
    double tau = hr_t > b->hr ? 1.0 : p->tau_rec, rel, hrv, spo2;
    double skin_tau = w->water || b->skin < p->skin_base - 2 ? 2.5 : 12;
    int a = d->act[t], stage = d->stage[t];

    b->hr += (hr_t - b->hr) * (1 - exp(-1 / tau));
    b->skin += (w->skin - b->skin) * (1 - exp(-1 / skin_tau));
    b->resp += (w->resp - b->resp) * (1 - exp(-1 / 1.5));
    b->eda += (w->eda - b->eda) * (1 - exp(-1 / 6.0));
    b->phasic *= exp(-1 / 3.0);
    if ((a == A_DESK && chance(r, p->stress)) || (a == A_REST && chance(r, p->stress / 4)))
        b->phasic += range(r, 0.4, 1.8);

    rel = fmax(0, b->hr - p->rest_hr) / (p->max_hr - p->rest_hr);
    hrv = p->hrv_base * exp(-2.8 * rel) * (a == A_SLEEP ? (stage == 2 ? 1.4 : 1.15) : 1) *
          (1 + 0.08 * gauss(r));
    spo2 = a == A_SLEEP ? 95.5 + 0.7 * gauss(r) - (chance(r, 0.01) ? range(r, 2, 4) : 0)
                        : 97.3 + 0.6 * gauss(r) - (w->effort > 0.4 ? 0.8 : 0);

    row[CH_HR] = quant(b->hr + 1.2 * gauss(r), 1);
    row[CH_STEPS] = quant(fmax(0, w->steps), 1);
    row[CH_SKIN] = quant(b->skin + 0.06 * gauss(r), 100);
    row[CH_EDA] = quant(fmax(0.01, (b->eda + b->phasic) * (1 + 0.03 * gauss(r))), 100);
    row[CH_SLEEP] = (float)(a == A_SLEEP ? stage : 0);
    row[CH_ACCEL] = quant(fmax(0, w->accel), 1000);
    row[CH_ALT] = quant(w->alt, 10);
    row[CH_SPO2] = w->accel > 0.15 || w->water ? NAN : quant(fmin(100, spo2), 1);
    row[CH_RESP] = quant(b->resp + 0.6 * gauss(r), 10);
    row[CH_HRV] = w->accel > 0.3 ? NAN : quant(fmax(1, hrv), 10);

    /* What the device loses: a loose strap now and then, single readings, the charger. */
    if (b->gap == 0 && chance(r, 0.004))
        b->gap = irange(r, 1, 5);
    if (b->gap > 0) {
        b->gap--;
        row[CH_HR] = row[CH_HRV] = NAN;
    }
    if (chance(r, 0.002))
        row[CH_SKIN] = NAN;
    if (chance(r, 0.002))
        row[CH_EDA] = NAN;
    if (chance(r, 0.002))
        row[CH_RESP] = NAN;
    if (d->off[t])
        for (int c = 0; c < NCH; c++)
            row[c] = NAN;
}

/* The day's grid, (DAY, NCH) time-major. */
static void simulate(const day *d, const person *p, rng *r, float *grid)
{
    body b = {
        .hr = p->rest_hr - 5, .skin = p->skin_base + 1.2, .resp = 13.5, .eda = p->eda_base * 0.55};
    int since = 0;
    want w;

    for (int t = 0; t < DAY; t++) {
        since = t > 0 && d->act[t] == d->act[t - 1] ? since + 1 : 0;
        targets(d, p, t, since, r, &w);
        read_minute(d, p, t, &w, &b, r, grid + (size_t)t * NCH);
    }
}

/* ---- captions ------------------------------------------------------------------------------ */

/* A caption under construction: clauses are appended whole while they fit in cap bytes, and
 * once one does not, nothing more is (the most informative come first). */
typedef struct caption {
    char s[TD_SENSOR_MAX_CAPTION + 1];
    size_t len, cap;
    int full;
    int open; /* clauses in the current sentence */
} caption;

/* Appends a clause: "; " before it within a sentence, ". " before a new sentence. */
static void clause(caption *c, int new_sentence, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void clause(caption *c, int new_sentence, const char *fmt, ...)
{
    char text[256];
    const char *sep = c->len == 0 ? "" : new_sentence ? ". " : "; ";
    size_t need;
    va_list ap;

    if (c->full)
        return;
    va_start(ap, fmt);
    vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    need = strlen(sep) + strlen(text) + 1; /* the final "." */
    if (c->len + need > c->cap) {
        c->full = 1;
        return;
    }
    c->len += (size_t)snprintf(c->s + c->len, sizeof(c->s) - c->len, "%s%s", sep, text);
}

static void finish_caption(caption *c)
{
    if (c->len > 0 && c->len < c->cap)
        c->s[c->len++] = '.';
    c->s[c->len] = '\0';
}

/* "07:05" for a minute of the day. */
static const char *hhmm(int m, char *buf)
{
    m = clampi(m, 0, DAY - 1);
    snprintf(buf, 6, "%02d:%02d", m / 60, m % 60);
    return buf;
}

/* "a" or "an" before a number of minutes said in English (an 8-, an 11-, an 18-, an 80-). */
static const char *article(int n)
{
    while (n >= 1000)
        n /= 1000;
    return n == 8 || n == 11 || n == 18 || (n >= 80 && n < 90) || (n >= 800 && n < 900) ? "an"
                                                                                        : "a";
}

/* The semantic part: the workout first, then sleep, desk work, short walks, the charger. */
static void semantic(caption *c, const day *d)
{
    char a[6], b[6], walks[128];
    int slept = 0, n = 0;

    if (d->label == L_REST)
        clause(c, 0, "%s: no workout", labels[d->label].prompt);
    else
        clause(c, 0, "%s: %s %d-minute %s at %s", labels[d->label].prompt, article(d->main_dur),
               d->main_dur, labels[d->label].noun, hhmm(d->main_start, a));
    for (int t = 0; t < DAY; t++)
        slept += d->act[t] == A_SLEEP && d->stage[t] != 0;
    if (d->bed < DAY)
        clause(c, 0, "%d h %d min of sleep, up at %s, in bed at %s", slept / 60, slept % 60,
               hhmm(d->wake, a), hhmm(d->bed, b));
    else
        clause(c, 0, "%d h %d min of sleep, up at %s", slept / 60, slept % 60, hhmm(d->wake, a));
    if (d->desk_end > 0)
        clause(c, 0, "desk work %s-%s", hhmm(d->desk_start, a), hhmm(d->desk_end, b));
    if (d->n_walks == 1)
        clause(c, 0, "%s %d-minute walk at %s", article(d->walk_dur[0]), d->walk_dur[0],
               hhmm(d->walk_start[0], a));
    for (int i = 0; d->n_walks > 1 && i < d->n_walks && i < 3; i++) /* three, then a count */
        n += snprintf(walks + n, sizeof(walks) - (size_t)n, "%s%s (%d min)", i ? ", " : "",
                      hhmm(d->walk_start[i], a), d->walk_dur[i]);
    if (d->n_walks > 3)
        snprintf(walks + n, sizeof(walks) - (size_t)n, " and %d more", d->n_walks - 3);
    if (d->n_walks > 1)
        clause(c, 0, "short walks at %s", walks);
    if (d->off_dur > 0)
        clause(c, 0, "watch off %d min at %s", d->off_dur, hhmm(d->off_start, a));
}

/* The largest change of channel ch over 10 minutes: the minute it starts, or -1. sign +1 for a
 * rise, -1 for a fall. */
static int largest_change(const float *g, int ch, int sign)
{
    double best = 0;
    int at = -1;

    for (int t = 0; t + 10 < DAY; t++) {
        float x = g[t * NCH + ch], y = g[(t + 10) * NCH + ch];
        if (!isnan(x) && !isnan(y) && sign * (y - x) > best) {
            best = sign * (y - x);
            at = t;
        }
    }
    return at;
}

/* The structural part: peaks, the times of the largest changes, when the steps came. */
static void structural(caption *c, const float *g)
{
    static const char *const part[3] = {"morning", "afternoon", "evening"};
    double peak = -1, steps[3] = {0, 0, 0};
    int peak_at = 0, at, most = 0;
    char a[6];

    for (int t = 0; t < DAY; t++) {
        float hr = g[t * NCH + CH_HR], st = g[t * NCH + CH_STEPS];
        if (!isnan(hr) && hr > peak) {
            peak = hr;
            peak_at = t;
        }
        if (!isnan(st) && t >= 300) /* from 05:00: morning to noon, afternoon to 17:00 */
            steps[t < 720 ? 0 : t < 1020 ? 1 : 2] += st;
    }
    if (peak >= 0)
        clause(c, 1, "heart rate peaks at %s (%.0f bpm)", hhmm(peak_at, a), peak);
    if ((at = largest_change(g, CH_HR, 1)) >= 0)
        clause(c, 0, "rises most at %s", hhmm(at, a));
    if ((at = largest_change(g, CH_HR, -1)) >= 0)
        clause(c, 0, "falls most at %s", hhmm(at, a));
    for (int i = 1; i < 3; i++)
        most = steps[i] > steps[most] ? i : most;
    if (steps[most] > 0)
        clause(c, 0, "steps mostly in the %s", part[most]);
    if ((at = largest_change(g, CH_SKIN, 1)) >= 0)
        clause(c, 0, "skin temperature rises most at %s", hhmm(at, a));
}

/* Mean, min and max of a channel over the day, NaNs left out; 0 readings: n 0. */
typedef struct summary {
    double mean, min, max, sum;
    int n;
} summary;

static summary summarise(const float *g, int ch)
{
    summary s = {0, INFINITY, -INFINITY, 0, 0};

    for (int t = 0; t < DAY; t++) {
        float x = g[t * NCH + ch];
        if (isnan(x))
            continue;
        s.sum += x;
        s.min = fmin(s.min, x);
        s.max = fmax(s.max, x);
        s.n++;
    }
    s.mean = s.n > 0 ? s.sum / s.n : 0;
    return s;
}

/* The statistical part: means and ranges per channel. */
static void statistical(caption *c, const float *g)
{
    summary hr = summarise(g, CH_HR), st = summarise(g, CH_STEPS), sk = summarise(g, CH_SKIN);
    summary eda = summarise(g, CH_EDA), o2 = summarise(g, CH_SPO2), rr = summarise(g, CH_RESP);
    summary alt = summarise(g, CH_ALT), hrv = summarise(g, CH_HRV);
    double climb = 0;

    for (int t = 0; t < DAY; t++)
        climb += !isnan(g[t * NCH + CH_ALT]) && g[t * NCH + CH_ALT] > 0.5 ? g[t * NCH + CH_ALT] : 0;
    if (hr.n > 0)
        clause(c, 1, "heart rate mean %.0f bpm, %.0f-%.0f", hr.mean, hr.min, hr.max);
    clause(c, 0, "%.0f steps", st.sum);
    if (sk.n > 0)
        clause(c, 0, "skin temperature %.1f-%.1f C", sk.min, sk.max);
    if (eda.n > 0)
        clause(c, 0, "EDA mean %.1f uS", eda.mean);
    if (o2.n > 0)
        clause(c, 0, "SpO2 mean %.0f%%", o2.mean);
    if (rr.n > 0)
        clause(c, 0, "respiration %.0f-%.0f per min", rr.min, rr.max);
    if (hrv.n > 0)
        clause(c, 0, "HRV mean %.0f ms", hrv.mean);
    if (alt.n > 0)
        clause(c, 0, "%.0f m climbed", climb);
}

static void make_caption(caption *c, const day *d, const float *grid, int cap)
{
    memset(c, 0, sizeof(*c));
    c->cap = (size_t)cap;
    semantic(c, d);
    structural(c, grid);
    statistical(c, grid);
    finish_caption(c);
}

/* ---- writing ------------------------------------------------------------------------------- */

/* The stream of person j of a split: a hash of (seed, split, j), so that each person's days
 * depend on nothing else. */
static void person_stream(rng *r, uint64_t seed, int split, int64_t j)
{
    rng h = {seed};

    h.s = rng_next(&h) ^ (SPLIT_STREAM + (uint64_t)split);
    h.s = rng_next(&h) ^ (uint64_t)j;
    r->s = rng_next(&h);
}

/* Writes one split of n days to path; counts[l] receives the days of each label. */
static int write_split(const tc_synth_opts *o, const char *path, int split, int64_t n,
                       const float *mean, const float *std, float *mean_out, float *std_out,
                       int64_t counts[NLABELS])
{
    const char *names[NLABELS], *prompts[NLABELS];
    td_sensor_header h = {.T = DAY,
                          .C = NCH,
                          .N = n,
                          .caption_len = o->caption_len,
                          .n_labels = NLABELS,
                          .period_s = PERIOD_S,
                          .split = split};
    td_sensor_writer *w = NULL;
    float *grid = malloc(sizeof(float) * DAY * NCH);
    td_error_t err = {0};
    caption *cap = malloc(sizeof(*cap));
    day *d = malloc(sizeof(*d));
    person p = {0};
    rng r = {0};
    int rc = TC_OK;

    if (grid == NULL || cap == NULL || d == NULL) {
        rc = tc_err(TC_FAILED, "out of memory");
        goto out;
    }
    for (int c = 0; c < NCH; c++) {
        snprintf(h.ch[c].name, sizeof(h.ch[c].name), "%s", channels[c].name);
        snprintf(h.ch[c].unit, sizeof(h.ch[c].unit), "%s", channels[c].unit);
    }
    for (int l = 0; l < NLABELS; l++) {
        names[l] = labels[l].name;
        prompts[l] = labels[l].prompts;
        counts[l] = 0;
    }
    if (td_sensor_writer_open(&w, path, &h, names, prompts, &err) != 0) {
        rc = tc_err(TC_CANTCREAT, "%s", err.msg);
        goto out;
    }
    for (int64_t i = 0; i < n; i++) {
        if (i % DAYS_EACH == 0) {
            person_stream(&r, o->seed, split, i / DAYS_EACH);
            make_person(&p, &r);
        }
        plan_day(d, &p, (int)(i % DAYS_EACH), &r);
        simulate(d, &p, &r, grid);
        make_caption(cap, d, grid, o->caption_len);
        if (td_sensor_writer_add(w, grid, cap->s, cap->len, d->label, &err) != 0) {
            rc = tc_err(TC_CANTCREAT, "%s", err.msg);
            goto out;
        }
        counts[d->label]++;
    }
    if (mean_out != NULL)
        td_sensor_writer_stats(w, mean_out, std_out);
    if (td_sensor_writer_finish(w, mean, std, &err) != 0)
        rc = tc_err(TC_CANTCREAT, "%s", err.msg);
out:
    td_sensor_writer_free(w);
    free(grid);
    free(cap);
    free(d);
    return rc;
}

int tc_sensor_synth(const tc_synth_opts *o)
{
    char train[4096], valid[4096];
    float mean[NCH], std[NCH];
    int64_t n_valid = llround((double)o->days * o->valid), n_train, tc[NLABELS], vc[NLABELS];
    int rc;

    n_valid = n_valid < 1 ? 1 : n_valid > o->days - 1 ? o->days - 1 : n_valid;
    n_train = o->days - n_valid;
    if (mkdir(o->dir, 0777) != 0 && errno != EEXIST)
        return tc_err(TC_CANTCREAT, "%s: cannot create the directory: %s", o->dir, strerror(errno));
    if (snprintf(train, sizeof(train), "%s/synth-train.bin", o->dir) >= (int)sizeof(train) ||
        snprintf(valid, sizeof(valid), "%s/synth-valid.bin", o->dir) >= (int)sizeof(valid))
        return tc_err(TC_USAGE, "%s: the directory's name is too long", o->dir);
    rc = write_split(o, train, TD_SENSOR_SPLIT_TRAIN, n_train, NULL, NULL, mean, std, tc);
    if (rc == TC_OK) /* the valid split carries the train split's statistics */
        rc = write_split(o, valid, TD_SENSOR_SPLIT_VALID, n_valid, mean, std, NULL, NULL, vc);
    if (rc != TC_OK)
        return rc;
    printf("sensor synth: %lld train days in %s, %lld valid days in %s; %d channels, %d minutes "
           "a day; labels (train+valid):",
           (long long)n_train, train, (long long)n_valid, valid, NCH, DAY);
    for (int l = 0; l < NLABELS; l++)
        printf(" %s %lld+%lld", labels[l].name, (long long)tc[l], (long long)vc[l]);
    printf("\n");
    return tc_flush_stdout();
}
