"""Healthcare: patients, doctors, appointments and prescriptions; book, cancel, refill.

Preconditions: a doctor can only be booked on a working day ("doctor_unavailable"); only a
booked appointment can be cancelled ("already_done" once it took place); a prescription without
refills left cannot be refilled ("no_refills"). Tickets are filed against the patient.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from lopd.envs.toolworld.core import (
    NAMES,
    P_OK,
    Domain,
    FieldIs,
    Ids,
    Instance,
    Param,
    RowAdded,
    Template,
    Ticket,
    Tool,
    ToolError,
    attempt,
    call,
    find_by_name,
    get_row,
    listing,
    next_id,
    ticket_check,
    ticket_tool,
)

SPECIALTIES = ("cardiology", "dermatology", "neurology", "pediatrics", "oncology", "radiology")
DAYS = ("mon", "tue", "wed", "thu", "fri")
DRUGS = ("insulin", "aspirin", "statin", "inhaler", "ibuprofen", "metformin", "penicillin",
         "vitamin")
REASONS = ("already_done", "no_refills", "doctor_unavailable")


@dataclass
class Patient:
    patient_id: str
    name: str


@dataclass
class Doctor:
    doctor_id: str
    specialty: str
    days: tuple[str, ...]  # working days


@dataclass
class Appointment:
    appointment_id: str
    patient_id: str
    doctor_id: str
    day: str
    status: str  # booked, done or cancelled


@dataclass
class Prescription:
    rx_id: str
    patient_id: str
    drug: str
    refills: int


@dataclass
class HealthDB:
    patients: dict[str, Patient]
    doctors: dict[str, Doctor]
    appointments: dict[str, Appointment]
    prescriptions: dict[str, Prescription]
    tickets: dict[str, Ticket] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------
# Tools


def find_patient(db: HealthDB, name: str) -> dict:
    patient = find_by_name(db.patients, name, "patient")
    return {"patient_id": patient.patient_id, "name": patient.name}


def list_appointments(db: HealthDB, patient_id: str) -> list[dict]:
    get_row(db.patients, patient_id, "patient")
    rows = [a for a in db.appointments.values() if a.patient_id == patient_id]
    return listing(rows, ("appointment_id", "doctor_id", "day", "status"))


def list_prescriptions(db: HealthDB, patient_id: str) -> list[dict]:
    get_row(db.patients, patient_id, "patient")
    rows = [r for r in db.prescriptions.values() if r.patient_id == patient_id]
    return listing(rows, ("rx_id", "drug", "refills"))


def list_doctors(db: HealthDB, specialty: str) -> list[dict]:
    rows = [d for d in db.doctors.values() if d.specialty == specialty]
    return listing(rows, ("doctor_id", "days"))


def book_appointment(db: HealthDB, patient_id: str, doctor_id: str, day: str) -> dict:
    get_row(db.patients, patient_id, "patient")
    doctor = get_row(db.doctors, doctor_id, "doctor")
    if day not in doctor.days:
        raise ToolError(f"doctor {doctor_id} is unavailable on {day}")
    appointment = Appointment(next_id(db.appointments, "V"), patient_id, doctor_id, day, "booked")
    db.appointments[appointment.appointment_id] = appointment
    return {"appointment_id": appointment.appointment_id, "doctor_id": doctor_id, "day": day,
            "status": appointment.status}


def cancel_appointment(db: HealthDB, appointment_id: str) -> dict:
    appointment = get_row(db.appointments, appointment_id, "appointment")
    if appointment.status == "done":
        raise ToolError(f"appointment {appointment_id} is already done and cannot be cancelled")
    if appointment.status != "booked":
        raise ToolError(f"appointment {appointment_id} is already {appointment.status}")
    appointment.status = "cancelled"
    return {"appointment_id": appointment_id, "status": appointment.status}


def refill_prescription(db: HealthDB, rx_id: str) -> dict:
    prescription = get_row(db.prescriptions, rx_id, "prescription")
    if prescription.refills < 1:
        raise ToolError(f"prescription {rx_id} has no refills left")
    prescription.refills -= 1
    return {"rx_id": rx_id, "refills": prescription.refills}


_PATIENT_ID = Param("string", "patient id")
TOOLS = (
    Tool("find_patient", "Find a patient by name", {"name": Param("string", "first name")},
         find_patient),
    Tool("list_appointments", "List a patient's appointments", {"patient_id": _PATIENT_ID},
         list_appointments),
    Tool("list_prescriptions", "List a patient's prescriptions", {"patient_id": _PATIENT_ID},
         list_prescriptions),
    Tool("list_doctors", "List doctors of a specialty",
         {"specialty": Param("string", "specialty", SPECIALTIES)}, list_doctors),
    Tool("book_appointment", "Book a patient with a doctor",
         {"patient_id": _PATIENT_ID, "doctor_id": Param("string", "doctor id"),
          "day": Param("string", "weekday", DAYS)}, book_appointment),
    Tool("cancel_appointment", "Cancel a booked appointment",
         {"appointment_id": Param("string", "appointment id")}, cancel_appointment),
    Tool("refill_prescription", "Use one refill of a prescription",
         {"rx_id": Param("string", "prescription id")}, refill_prescription),
    ticket_tool("patient_id", "patient", "patients", REASONS),
)


# ----------------------------------------------------------------------------------------------
# Worlds


def _world(rng: random.Random, ids: Ids) -> tuple[HealthDB, Patient]:
    """Three patients, three or four doctors, a few appointments and prescriptions; returns the
    task's patient."""
    db = HealthDB({}, {}, {}, {})
    for _ in range(rng.randint(3, 4)):
        _add_doctor(db, ids, rng, rng.choice(SPECIALTIES))
    for name in rng.sample(NAMES, 3):
        patient = Patient(ids.new("N"), name)
        db.patients[patient.patient_id] = patient
        for _ in range(rng.randint(0, 2)):
            _add_appointment(db, ids, rng, patient, rng.choice(("booked", "done", "cancelled")))
        for _ in range(rng.randint(0, 2)):
            _add_prescription(db, ids, rng, patient, rng.randint(0, 3))
    return db, rng.choice(list(db.patients.values()))


def _add_doctor(db: HealthDB, ids: Ids, rng: random.Random, specialty: str,
                days: tuple[str, ...] | None = None) -> Doctor:
    if days is None:
        days = tuple(sorted(rng.sample(DAYS, rng.randint(2, 3)), key=DAYS.index))
    doctor = Doctor(ids.new("D"), specialty, days)
    db.doctors[doctor.doctor_id] = doctor
    return doctor


def _add_appointment(db: HealthDB, ids: Ids, rng: random.Random, patient: Patient,
                     status: str) -> Appointment:
    """An appointment on a day this patient has none yet, so days name appointments."""
    taken = {a.day for a in db.appointments.values() if a.patient_id == patient.patient_id}
    doctor = rng.choice(list(db.doctors.values()))
    appointment = Appointment(ids.new("V"), patient.patient_id, doctor.doctor_id,
                              rng.choice([d for d in DAYS if d not in taken]), status)
    db.appointments[appointment.appointment_id] = appointment
    return appointment


def _add_prescription(db: HealthDB, ids: Ids, rng: random.Random, patient: Patient,
                      refills: int) -> Prescription:
    """A prescription of a drug this patient has none of yet, so drugs name prescriptions."""
    taken = {r.drug for r in db.prescriptions.values() if r.patient_id == patient.patient_id}
    prescription = Prescription(ids.new("R"), patient.patient_id,
                                rng.choice([d for d in DRUGS if d not in taken]), refills)
    db.prescriptions[prescription.rx_id] = prescription
    return prescription


def _ticket(patient: Patient, reason: str) -> tuple[dict, str, str]:
    return (call("open_ticket", patient_id=patient.patient_id, reason=reason),
            patient.patient_id, reason)


def _booking(patient: Patient, doctor: Doctor, day: str) -> RowAdded:
    return RowAdded("appointments", (("patient_id", patient.patient_id),
                                     ("doctor_id", doctor.doctor_id), ("day", day),
                                     ("status", "booked")))


def _cancel(rng: random.Random, ids: Ids, db: HealthDB, patient: Patient, lookups: list[dict],
            instruction: Callable[[Appointment], str]) -> Instance:
    fails = rng.random() >= P_OK
    appointment = _add_appointment(db, ids, rng, patient, "done" if fails else "booked")
    return attempt(instruction(appointment), db, lookups,
                   call("cancel_appointment", appointment_id=appointment.appointment_id),
                   [FieldIs("appointments", appointment.appointment_id, "status", "cancelled")],
                   _ticket(patient, "already_done") if fails else None)


def _refill(rng: random.Random, ids: Ids, db: HealthDB, patient: Patient, lookups: list[dict],
            instruction: Callable[[Prescription], str]) -> Instance:
    fails = rng.random() >= P_OK
    prescription = _add_prescription(db, ids, rng, patient, 0 if fails else rng.randint(1, 3))
    return attempt(instruction(prescription), db, lookups,
                   call("refill_prescription", rx_id=prescription.rx_id),
                   [FieldIs("prescriptions", prescription.rx_id, "refills",
                            prescription.refills - 1)],
                   _ticket(patient, "no_refills") if fails else None)


def _book_specialty(rng: random.Random, ids: Ids, db: HealthDB, patient: Patient,
                    lookups: list[dict], instruction: Callable[[str, str], str]) -> Instance:
    """The oracle lists the specialty's doctors: one works that day, or none does (report)."""
    specialty, day = rng.choice(SPECIALTIES), rng.choice(DAYS)
    for doctor in db.doctors.values():
        if doctor.specialty == specialty and day in doctor.days:
            doctor.days = tuple(d for d in doctor.days if d != day)
    lookups = lookups + [call("list_doctors", specialty=specialty)]
    other_days = [d for d in DAYS if d != day]
    if rng.random() < P_OK:
        days = tuple(sorted([day] + rng.sample(other_days, rng.randint(1, 2)), key=DAYS.index))
        doctor = _add_doctor(db, ids, rng, specialty, days)
        action = call("book_appointment", patient_id=patient.patient_id,
                      doctor_id=doctor.doctor_id, day=day)
        return Instance(instruction(specialty, day), db, lookups + [action],
                        [_booking(patient, doctor, day)], "ok")
    if rng.random() < 0.5:
        _add_doctor(db, ids, rng, specialty, tuple(sorted(rng.sample(other_days, 2),
                                                          key=DAYS.index)))
    ticket, target, reason = _ticket(patient, "doctor_unavailable")
    return Instance(instruction(specialty, day), db, lookups + [ticket],
                    [ticket_check(target, reason)], reason)


# ----------------------------------------------------------------------------------------------
# Templates


def cancel_appointment_tpl(rng: random.Random) -> Instance:
    ids = Ids(rng)
    db, p = _world(rng, ids)
    return _cancel(rng, ids, db, p, [], lambda a: (
        f"Cancel appointment {a.appointment_id} of patient {p.patient_id}."))


def cancel_by_day_name(rng: random.Random) -> Instance:
    ids = Ids(rng)
    db, p = _world(rng, ids)
    return _cancel(
        rng, ids, db, p,
        [call("find_patient", name=p.name), call("list_appointments", patient_id=p.patient_id)],
        lambda a: f"Cancel the {a.day} appointment of patient {p.name}.")


def refill_tpl(rng: random.Random) -> Instance:
    ids = Ids(rng)
    db, p = _world(rng, ids)
    return _refill(rng, ids, db, p, [], lambda r: (
        f"Refill prescription {r.rx_id} of patient {p.patient_id}."))


def refill_by_name(rng: random.Random) -> Instance:
    ids = Ids(rng)
    db, p = _world(rng, ids)
    return _refill(
        rng, ids, db, p,
        [call("find_patient", name=p.name), call("list_prescriptions", patient_id=p.patient_id)],
        lambda r: f"Refill the {r.drug} prescription of patient {p.name}.")


def book_doctor(rng: random.Random) -> Instance:
    ids = Ids(rng)
    db, p = _world(rng, ids)
    doctor = rng.choice(list(db.doctors.values()))
    fails = rng.random() >= P_OK
    day = rng.choice([d for d in DAYS if (d in doctor.days) != fails])
    return attempt(f"Book patient {p.patient_id} with doctor {doctor.doctor_id} on {day}.", db, [],
                   call("book_appointment", patient_id=p.patient_id, doctor_id=doctor.doctor_id,
                        day=day),
                   [_booking(p, doctor, day)],
                   _ticket(p, "doctor_unavailable") if fails else None)


def book_specialty(rng: random.Random) -> Instance:
    ids = Ids(rng)
    db, p = _world(rng, ids)
    return _book_specialty(rng, ids, db, p, [], lambda specialty, day: (
        f"Book patient {p.patient_id} with a {specialty} doctor on {day}."))


def book_specialty_by_name(rng: random.Random) -> Instance:
    ids = Ids(rng)
    db, p = _world(rng, ids)
    return _book_specialty(rng, ids, db, p, [call("find_patient", name=p.name)],
                           lambda specialty, day: (
                               f"Book patient {p.name} with a {specialty} doctor on {day}."))


def cancel_all_booked(rng: random.Random) -> Instance:
    ids = Ids(rng)
    db, p = _world(rng, ids)
    others = ("done", "cancelled")
    mine = [a for a in db.appointments.values() if a.patient_id == p.patient_id]
    for appointment in mine:  # the template decides how many appointments match
        if appointment.status == "booked":
            appointment.status = rng.choice(others)
    if not mine:
        _add_appointment(db, ids, rng, p, rng.choice(others))
    # The patient has at most two appointments so far: three more fit in the five weekdays.
    targets = sorted(_add_appointment(db, ids, rng, p, "booked").appointment_id
                     for _ in range(rng.randint(1, 3)))
    return Instance(f"Cancel all booked appointments of patient {p.patient_id}.", db,
                    [call("list_appointments", patient_id=p.patient_id)]
                    + [call("cancel_appointment", appointment_id=a) for a in targets],
                    [FieldIs("appointments", a, "status", "cancelled") for a in targets], "ok")


DOMAIN = Domain("healthcare", "a healthcare", TOOLS, (
    Template("cancel_appointment", 3, cancel_appointment_tpl),
    Template("refill", 3, refill_tpl),
    Template("book_doctor", 3, book_doctor),
    Template("book_specialty", 2, book_specialty),
    Template("refill_by_name", 2, refill_by_name),
    Template("cancel_by_day_name", 2, cancel_by_day_name),
    Template("book_specialty_by_name", 2, book_specialty_by_name),
    Template("cancel_all_booked", 1.5, cancel_all_booked),
))
